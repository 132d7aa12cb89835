"""What every grader shares: the sample it grades, the result it returns, and the `Grader` base
class that validates a spec (all problems at once) and turns sample failures into data."""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from training.rewards.errors import GraderSpecError, GradingError
from training.rewards.templates import Template, TemplateSyntaxError


@dataclass
class Sample:
    """One trajectory as graders see it, named as in OpenAI's grader templates."""

    output_text: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    output_tools: list[dict[str, Any]] = field(default_factory=list)

    @cached_property
    def output_json(self) -> Any:
        # Parsed only when a template asks for it: a plain-text answer is not an error for a
        # grader that never looks at JSON.
        try:
            return json.loads(self.output_text)
        except ValueError as error:
            raise GradingError("sample_parse_error", f"output_text is not valid JSON: {error}") from None


@dataclass
class GradeResult:
    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    execution_time: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Field:
    """One spec field. `kind` is "string", "number" or "string_list"; `choices` constrains strings
    (each element of a string_list); `template` strings are parsed as templates at validation."""

    kind: str
    required: bool = False
    default: Any = None
    choices: tuple[str, ...] = ()
    template: bool = False


# Fields every grader accepts. `name` defaults to the grader's type (see `Grader.validate`).
COMMON_FIELDS: dict[str, Field] = {
    "type": Field("string", required=True),
    "name": Field("string"),
    "error_reward": Field("number", default=0.0),
}

_KIND_WORDS = {"string": "a string", "number": "a finite number", "string_list": "a list of strings"}


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "number":
        # bool is an int in Python but never what a spec author meant by a score.
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "string_list":
        return isinstance(value, list) and all(isinstance(element, str) for element in value)
    raise AssertionError(f"unknown field kind {kind!r}")


class Grader(ABC):
    """Base class: subclasses declare `type` and `fields`, implement `score`, and may add
    cross-field checks in `check_spec`. Register a new grader in `registry.GRADER_TYPES`."""

    type: ClassVar[str]
    fields: ClassVar[dict[str, Field]] = {}

    def __init__(self, spec: dict[str, Any]) -> None:
        """`spec` must already be normalised by `validate` (use `build_grader`)."""
        self.spec = spec
        self.name: str = spec["name"]
        self.error_reward: float = spec["error_reward"]

    @classmethod
    def validate(cls, spec: Any, path: str = "grader") -> dict[str, Any]:
        """Return the spec with defaults filled in, or raise GraderSpecError with every problem."""
        if not isinstance(spec, dict):
            raise GraderSpecError([{"path": path, "message": "must be an object"}])
        fields = {**COMMON_FIELDS, **cls.fields}
        problems = [
            {"path": f"{path}.{key}", "message": "unknown field"} for key in spec if key not in fields
        ]
        normalised: dict[str, Any] = {}
        for key, spec_field in fields.items():
            field_path = f"{path}.{key}"
            if key not in spec:
                if spec_field.required:
                    problems.append({"path": field_path, "message": "is required"})
                elif key == "name":
                    normalised[key] = cls.type
                else:
                    # Copy so a normalised spec never shares a mutable default with another.
                    normalised[key] = json.loads(json.dumps(spec_field.default))
                continue
            value = spec[key]
            field_problems = _field_problems(spec_field, value, field_path)
            problems += field_problems
            if not field_problems:
                normalised[key] = float(value) if spec_field.kind == "number" else value
        # Cross-field checks see only the fields that passed, so they run even when others failed
        # and the author gets every problem in one round.
        if normalised.get("type", cls.type) != cls.type:
            problems.append({"path": f"{path}.type", "message": f"must be {cls.type!r}"})
        problems += cls.check_spec(normalised, path)
        if problems:
            raise GraderSpecError(problems)
        return normalised

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        """Extra checks beyond field types; `spec` holds only the fields that passed."""
        return []

    def grade(self, sample: Sample, item: dict[str, Any]) -> GradeResult:
        started = time.perf_counter()
        try:
            reward = self.score(sample, item)
            errors: list[dict[str, str]] = []
        except GradingError as error:
            reward = self.error_reward
            errors = [{"code": error.code, "detail": error.detail, "grader": self.name}]
        return GradeResult(
            reward=reward,
            sub_rewards={self.name: reward},
            errors=errors,
            execution_time=time.perf_counter() - started,
        )

    @abstractmethod
    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        """The reward for one sample; raise GradingError for a sample that cannot be graded."""


def _field_problems(spec_field: Field, value: Any, path: str) -> list[dict[str, str]]:
    if not _has_kind(value, spec_field.kind):
        return [{"path": path, "message": f"must be {_KIND_WORDS[spec_field.kind]}"}]
    problems = []
    if spec_field.choices:
        allowed = ", ".join(spec_field.choices)
        if spec_field.kind == "string_list":
            for index, element in enumerate(value):
                if element not in spec_field.choices:
                    problems.append({"path": f"{path}.{index}", "message": f"must be one of {allowed}"})
        elif value not in spec_field.choices:
            problems.append({"path": path, "message": f"must be one of {allowed}"})
    if spec_field.template:
        try:
            Template.parse(value)
        except TemplateSyntaxError as error:
            problems.append({"path": path, "message": str(error)})
    return problems
