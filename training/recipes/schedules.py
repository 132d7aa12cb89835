"""Learning-rate schedules: the rate of each step of a run, a pure function of the config.

``index`` counts the run's steps from 1 to ``total`` (a run started from a checkpoint counts its own
steps, not the model's), so a resumed run finds the rate its dead worker would have used.

- warm-up: steps 1..W (``warmup_steps``) rise linearly, ``lr · i / (W + 1)``;
- then ``constant`` stays at ``lr``; ``cosine`` and ``linear`` fall from ``lr`` at step W + 1 to the
  floor ``lr · min_lr_ratio`` at the last step (cosine: half a cosine period; linear: a straight line).
"""

from __future__ import annotations

import math
from typing import Any

# The default peak learning rate (``learning_rate`` left empty) of a LoRA adapter, per objective,
# on a base model of ``REFERENCE_WIDTH`` (the bundled SmolLM2-135M):
# - grpo 1e-3: measured by benchmarks/sample_efficiency.py over three seeds (config ``lean``, the
#   other defaults below): TRL's 12-step held-out arithmetic reward within 6 steps on every seed and
#   its format reward matched, where a 1.5e-3 peak lost format (benchmarks/README.md);
# - sft 5e-4: the bundled model's SFT curve (benchmarks/tinker_curves.py);
# - dpo 2e-4: measured by benchmarks/dpo_rates.py (the format task's questions as preferences, 12
#   steps): held-out preference accuracy 0.54 -> 1.00 and the task's reward kept, where 1e-4 reached
#   0.88 and 5e-4 lost some of the reward its greedy answers had (benchmarks/README.md).
# A wider model gets a smaller rate, ``(REFERENCE_WIDTH / width) ** WIDTH_EXPONENT`` times it: the
# optimal LoRA rate falls with the width roughly as width^-0.78 in Thinking Machines' sweeps over
# Llama models (their published fit; at width 576 it gives 1.3e-3 for RL, near the 1e-3 measured
# here). A narrower model than the reference gets the reference's rate (not extrapolated upward).
REFERENCE_WIDTH = 576
PEAK_LEARNING_RATES = {"grpo": 1e-3, "sft": 5e-4, "dpo": 2e-4}
WIDTH_EXPONENT = 0.78
# A base model whose width this host cannot read (a hub id only GPU workers hold): a 7-8B model's.
UNKNOWN_WIDTH = 4096


def default_learning_rate(width: int | None, objective: str = "grpo") -> float:
    """The peak learning rate a run of ``objective`` gets when its config leaves it empty, for a
    base model of hidden size ``width`` (None: unknown, ``UNKNOWN_WIDTH`` assumed). Rounded to two
    significant digits, so the run's config shows a readable number."""
    size = width if width and width > 0 else UNKNOWN_WIDTH
    rate = PEAK_LEARNING_RATES[objective] * min(1.0, (REFERENCE_WIDTH / size) ** WIDTH_EXPONENT)
    return float(f"{rate:.2g}")


def learning_rate_at(config: Any, index: int, total: int) -> float:
    """The learning rate of step ``index`` (1-based) of a run of ``total`` steps. ``config`` has
    ``learning_rate``, ``lr_schedule``, ``warmup_steps`` and ``min_lr_ratio`` (a TrainConfig)."""
    if not 1 <= index <= max(total, 1):
        raise ValueError(f"step {index} is outside the run's steps 1..{total}")
    peak = float(config.learning_rate)
    warmup = int(config.warmup_steps)
    if index <= warmup:
        return peak * index / (warmup + 1)
    if config.lr_schedule == "constant":
        return peak
    floor = peak * float(config.min_lr_ratio)
    progress = (index - warmup - 1) / max(total - warmup - 1, 1)
    if config.lr_schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if config.lr_schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    raise ValueError(f"unknown lr_schedule {config.lr_schedule!r}")
