"""Reward graders: pure functions of (sample, item) that return a reward.

    grader = build_grader({"type": "string_check", "input": "{{sample.output_text}}",
                           "reference": "{{item.answer}}", "operation": "eq"})
    grade(grader, Sample(output_text="4"), {"answer": "4"}).reward  # 1.0

Specs follow OpenAI's grader shapes where one exists. No Django here: graders run in workers.
"""

from training.rewards.base import Field, Grader, GradeResult, Sample
from training.rewards.errors import GraderSpecError, GradingError
from training.rewards.registry import GRADER_TYPES, build_grader, grade, grade_many, validate_grader

__all__ = [
    "GRADER_TYPES",
    "Field",
    "GradeResult",
    "Grader",
    "GraderSpecError",
    "GradingError",
    "Sample",
    "build_grader",
    "grade",
    "grade_many",
    "validate_grader",
]
