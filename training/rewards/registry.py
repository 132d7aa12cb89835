"""The grader registry and the functions callers use. Adding a grader type is one module with a
`Grader` subclass plus one line in GRADER_TYPES; an explicit dict (not import-time registration
by decorator) so the full list of types is readable in one place."""

from __future__ import annotations

from typing import Any

from training.rewards.base import Grader, GradeResult, Sample
from training.rewards.errors import GraderSpecError
from training.rewards.regex import RegexGrader
from training.rewards.string_check import StringCheckGrader

GRADER_TYPES: dict[str, type[Grader]] = {
    StringCheckGrader.type: StringCheckGrader,
    RegexGrader.type: RegexGrader,
}


def validate_grader(spec: Any, path: str = "grader") -> dict[str, Any]:
    """Return the normalised spec (defaults filled in) or raise GraderSpecError with all problems."""
    if not isinstance(spec, dict):
        raise GraderSpecError([{"path": path, "message": "must be an object"}])
    if "type" not in spec:
        raise GraderSpecError([{"path": f"{path}.type", "message": "is required"}])
    grader_type = spec["type"]
    if not isinstance(grader_type, str) or grader_type not in GRADER_TYPES:
        allowed = ", ".join(GRADER_TYPES)
        raise GraderSpecError([{"path": f"{path}.type", "message": f"must be one of {allowed}"}])
    return GRADER_TYPES[grader_type].validate(spec, path)


def build_grader(spec: dict[str, Any]) -> Grader:
    normalised = validate_grader(spec)
    return GRADER_TYPES[normalised["type"]](normalised)


def grade(spec_or_grader: dict[str, Any] | Grader, sample: Sample, item: dict[str, Any]) -> GradeResult:
    grader = spec_or_grader if isinstance(spec_or_grader, Grader) else build_grader(spec_or_grader)
    return grader.grade(sample, item)


def grade_many(
    grader: dict[str, Any] | Grader, samples: list[Sample], items: list[dict[str, Any]]
) -> list[GradeResult]:
    """Grade samples[i] against items[i]; a spec is validated once for the whole batch."""
    if len(samples) != len(items):
        raise ValueError(f"got {len(samples)} samples but {len(items)} items")
    built = grader if isinstance(grader, Grader) else build_grader(grader)
    return [built.grade(sample, item) for sample, item in zip(samples, items, strict=True)]
