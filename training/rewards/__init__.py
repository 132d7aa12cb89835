"""Reward graders: pure functions of (sample, item), or of a group for `ruler`, that return a reward.

    grader = build_grader({"type": "string_check", "input": "{{sample.output_text}}",
                           "reference": "{{item.answer}}", "operation": "eq"})
    grade(grader, Sample(output_text="4"), {"answer": "4"}).reward  # 1.0

Specs follow OpenAI's grader shapes where one exists. No Django here: graders run in workers;
judge endpoints and sandbox limits are handed in by the caller (`build_grader(spec, judge=...,
sandbox=...)`), never read from settings.

The names below load on first use (PEP 562), not when the package is imported: importing
`training.rewards.sandbox` imports this package first, and the sandbox must load with the standard
library alone (the unprivileged-sandbox test runs it as nobody under the system Python, without
this project's packages; the judge's chain pulls in `idna` through `training.safety.outbound`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.rewards.base import Field, Grader, GradeResult, GraderRuntime, Sample
    from training.rewards.errors import GraderSetupError, GraderSpecError, GradingError, RewardFailure
    from training.rewards.judge import JudgeClient
    from training.rewards.registry import (
        GRADER_TYPES,
        build_grader,
        grade,
        grade_group,
        grade_many,
        grade_trajectories,
        validate_grader,
    )
    from training.rewards.sandbox import SandboxConfig, SandboxUnavailable, sandbox_mode

# name -> the module that defines it
_HOMES = {
    **dict.fromkeys(("Field", "Grader", "GradeResult", "GraderRuntime", "Sample"), "base"),
    **dict.fromkeys(("GraderSetupError", "GraderSpecError", "GradingError", "RewardFailure"), "errors"),
    "JudgeClient": "judge",
    **dict.fromkeys(
        (
            "GRADER_TYPES",
            "build_grader",
            "grade",
            "grade_group",
            "grade_many",
            "grade_trajectories",
            "validate_grader",
        ),
        "registry",
    ),
    **dict.fromkeys(("SandboxConfig", "SandboxUnavailable", "sandbox_mode"), "sandbox"),
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


__all__ = [
    "GRADER_TYPES",
    "Field",
    "GradeResult",
    "Grader",
    "GraderRuntime",
    "GraderSetupError",
    "GraderSpecError",
    "GradingError",
    "JudgeClient",
    "RewardFailure",
    "Sample",
    "SandboxConfig",
    "SandboxUnavailable",
    "build_grader",
    "grade",
    "grade_group",
    "grade_many",
    "grade_trajectories",
    "sandbox_mode",
    "validate_grader",
]
