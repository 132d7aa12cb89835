"""Whether a group of rewards carries a learning signal, over plain floats: the rule the GRPO
update (training.recipes.grpo) and the platform's pages share. No torch here: every Django process
imports this at start-up."""

from __future__ import annotations

# Rewards this close count as equal: the group carries no learning signal.
ZERO_VARIANCE_TOLERANCE = 1e-8


def is_zero_variance(rewards: list[float]) -> bool:
    """True when a group's rewards are all equal: it carries no learning signal."""
    return not rewards or max(rewards) - min(rewards) <= ZERO_VARIANCE_TOLERANCE
