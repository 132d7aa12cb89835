"""What the training core offers, as the domain serves it to the API and the dashboard: the run
hyperparameters with their defaults and help, and the environment kinds with their tools and
config keys. Pages and API views read these here, never from ``training`` directly."""

from __future__ import annotations

from typing import Any

from projects.grader_secrets import grader_public
from training.config import TrainConfig
from training.recipes import signal
from training.rewards import GraderSetupError, GraderSpecError, build_grader


def is_zero_variance(rewards: list[float]) -> bool:
    """Whether a group's rewards give GRPO no signal (training.recipes.signal's rule: the trainer's own)."""
    return signal.is_zero_variance(rewards)


def hyperparameters() -> dict[str, dict[str, Any]]:
    """Every run hyperparameter: ``{name: {type, default, help[, choices]}}``."""
    return TrainConfig.field_help()


def environment_kinds() -> list[dict[str, Any]]:
    """Every environment kind of the registry (``training.environments``) with its description,
    tools, config keys and how its final answer is read. Raises ImportError where the registry's
    dependencies are missing."""
    from training.environments import describe_kinds

    return describe_kinds()


def reward_range(spec: dict[str, Any]) -> tuple[float, float] | None:
    """The [low, high] a grader spec declares for its reward (a python grader's ``range``), or
    None when it declares none. A spec that needs a judge to be built declares none here."""
    try:
        return build_grader(grader_public(spec)).reward_range()  # masked headers: no secret needed
    except (GraderSpecError, GraderSetupError):
        return None
