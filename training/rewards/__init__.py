"""Reward graders: pure functions of (sample, item), or of a group for `ruler`, that return a reward.

    grader = build_grader({"type": "string_check", "input": "{{sample.output_text}}",
                           "reference": "{{item.answer}}", "operation": "eq"})
    grade(grader, Sample(output_text="4"), {"answer": "4"}).reward  # 1.0

Specs follow OpenAI's grader shapes where one exists. No Django here: graders run in workers;
judge endpoints and sandbox limits are handed in by the caller (`build_grader(spec, judge=...,
sandbox=...)`), never read from settings.
"""

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
