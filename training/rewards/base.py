"""What every grader shares: the sample it grades, the result it returns, and the `Grader` base
class that validates a spec (all problems at once) and turns sample failures into data."""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from training import names
from training.rewards.errors import GraderSpecError, GradingError
from training.rewards.judge import JudgeClient
from training.rewards.sandbox import SandboxConfig
from training.rewards.templates import Template, TemplateSyntaxError
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy
from training.safety.slots import SlotsBusy


@dataclass
class Sample:
    """One trajectory as graders see it, named as in OpenAI's grader templates.

    `messages` is the whole transcript (ending with the final answer for multi-turn rollouts);
    `output_tools` lists the tool calls, each `{"name", "arguments"}` (arguments a dict or a JSON
    string). When only `messages` is given, the assistant messages' `tool_calls` fill it in.
    `outcome` is the environment's verdict on the episode (`{"result": "win", "reward": 1.0}` for
    a game; `{}` for chat and tool environments), see `training/environments`."""

    output_text: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    output_tools: list[dict[str, Any]] = field(default_factory=list)
    outcome: dict[str, Any] = field(default_factory=dict)
    # Where the sample comes from (a run's step, group, rollout, row index), for graders that
    # report back to the team (`endpoint`); {} for a one-off grade.
    ids: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.output_tools:
            self.output_tools = tool_calls_from_messages(self.messages)

    @cached_property
    def output_json(self) -> Any:
        # Parsed only when a template asks for it: a plain-text answer is not an error for a
        # grader that never looks at JSON.
        try:
            return json.loads(self.output_text)
        except ValueError as error:
            raise GradingError("sample_parse_error", f"output_text is not valid JSON: {error}") from None

    def to_grader_dict(self) -> dict[str, Any]:
        """The `sample` argument of a python grader's `grade(sample, item)` (OpenAI's shape)."""
        try:
            output_json = self.output_json
        except GradingError:
            output_json = None
        return {
            "output_text": self.output_text,
            "output_json": output_json,
            "output_tools": self.output_tools,
            "messages": self.messages,
            "outcome": self.outcome,
        }


def tool_calls_from_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            function = call["function"] if isinstance(call.get("function"), dict) else call
            calls.append({"name": function.get("name"), "arguments": function.get("arguments", {})})
    return calls


@dataclass
class GradeResult:
    """One sample's grade. `errors` entries are `{"code", "detail", "grader"}`; `scores` holds
    grader-specific details (a judge's raw score, a label, RULER's original reward);
    `token_usage` maps each judge model to `{"prompt_tokens", "completion_tokens", "total_tokens"}`."""

    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)
    errors: list[dict[str, str]] = field(default_factory=list)
    execution_time: float = 0.0
    name: str = ""
    type: str = ""
    scores: dict[str, Any] = field(default_factory=dict)
    token_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    sampled_model_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_openai_dict(self) -> dict[str, Any]:
        """The shape of OpenAI's `POST /v1/fine_tuning/alpha/graders/run` response. `errors` is
        OpenAI's object of flags; `error_details` (ours) keeps every entry with its detail."""
        total_tokens = sum(usage.get("total_tokens", 0) for usage in self.token_usage.values())
        return {
            "reward": self.reward,
            "sub_rewards": dict(self.sub_rewards),
            "model_grader_token_usage_per_model": {model: dict(u) for model, u in self.token_usage.items()},
            "metadata": {
                "name": self.name,
                "type": self.type,
                "errors": openai_error_flags(self.errors),
                "error_details": [dict(error) for error in self.errors],
                "execution_time": self.execution_time,
                "scores": dict(self.scores),
                "token_usage": total_tokens if self.token_usage else None,
                "sampled_model_name": self.sampled_model_name,
            },
        }


# Our error codes as OpenAI's flags; codes not listed count as `other_error`.
OPENAI_ERROR_FLAGS = {
    "formula_parse_error": "formula_parse_error",
    "sample_parse_error": "sample_parse_error",
    "template_error": "invalid_variable_error",
    "python_grader_runtime_error": "python_grader_runtime_error",
    "memory_limit": "python_grader_runtime_error",
    "timeout": "unresponsive_reward_error",
    "regex_timeout": "unresponsive_reward_error",
    "endpoint_grader_timeout": "unresponsive_reward_error",
    "python_grader_server_error": "python_grader_server_error",
    "model_grader_server_error": "model_grader_server_error",
    "model_grader_parse_error": "model_grader_parse_error",
}
# A judge's refusal is reported as a parse error whose detail starts with this (OpenAI also sets
# its refusal flag).
REFUSAL_PREFIX = "refusal"


def openai_error_flags(errors: list[dict[str, str]]) -> dict[str, Any]:
    flags: dict[str, Any] = {
        "formula_parse_error": False,
        "sample_parse_error": False,
        "truncated_observation_error": False,
        "unresponsive_reward_error": False,
        "invalid_variable_error": False,
        "other_error": False,
        "python_grader_server_error": False,
        "python_grader_server_error_type": None,
        "python_grader_runtime_error": False,
        "python_grader_runtime_error_details": None,
        "model_grader_server_error": False,
        "model_grader_refusal_error": False,
        "model_grader_parse_error": False,
        "model_grader_server_error_details": None,
    }
    for error in errors:
        flag = OPENAI_ERROR_FLAGS.get(error.get("code", ""), "other_error")
        flags[flag] = True
        detail = error.get("detail")
        if flag == "python_grader_runtime_error" and flags["python_grader_runtime_error_details"] is None:
            flags["python_grader_runtime_error_details"] = detail
        elif flag == "python_grader_server_error" and flags["python_grader_server_error_type"] is None:
            flags["python_grader_server_error_type"] = detail
        elif flag == "model_grader_server_error" and flags["model_grader_server_error_details"] is None:
            flags["model_grader_server_error_details"] = detail
        elif flag == "model_grader_parse_error" and (detail or "").startswith(REFUSAL_PREFIX):
            flags["model_grader_refusal_error"] = True
    return flags


@dataclass
class Score:
    """What `Grader.score` may return instead of a bare float, when there is more to record."""

    reward: float
    scores: dict[str, Any] = field(default_factory=dict)
    token_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    sampled_model_name: str | None = None


@dataclass(frozen=True)
class GraderRuntime:
    """What a grader may use beyond its spec, supplied by the caller: the team's judge endpoint and
    the operator's sandbox limits and outbound policy. Graders never read settings or secrets themselves."""

    judge: JudgeClient | None = None
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    outbound: OutboundPolicy = PUBLIC_ONLY  # which hosts an endpoint grader may call


@dataclass(frozen=True)
class Field:
    """One spec field. `kind` is one of KIND_WORDS; `choices` constrains strings (each element of a
    string_list); `template` strings are parsed as templates at validation."""

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

KIND_WORDS = {
    "string": "a string",
    "number": "a finite number",
    "boolean": "true or false",
    "string_list": "a list of strings",
    "number_list": "a list of finite numbers",
    "list": "a list",
    "object": "an object",
    "any": "a JSON value",
}


def is_number(value: Any) -> bool:
    # bool is an int in Python but never what a spec author meant by a score.
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _has_kind(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "number":
        return is_number(value)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string_list":
        return isinstance(value, list) and all(isinstance(element, str) for element in value)
    if kind == "number_list":
        return isinstance(value, list) and all(is_number(element) for element in value)
    if kind == "list":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "any":
        return True
    raise AssertionError(f"unknown field kind {kind!r}")


def _normalise(kind: str, value: Any) -> Any:
    if kind == "number":
        return float(value)
    if kind == "number_list":
        return [float(element) for element in value]
    # Copy so a normalised spec never shares mutable state with the caller's.
    return json.loads(json.dumps(value)) if isinstance(value, dict | list) else value


class Grader(ABC):
    """Base class: subclasses declare `type` and `fields`, implement `score`, and may add
    cross-field checks in `check_spec`. Register a new grader in `registry.GRADER_TYPES`.

    `grade_batch` grades independent samples (override it to share set-up, as the python grader
    shares one sandbox process); `grade_group` grades one GRPO group (override it for graders that
    compare the group's samples, as `ruler` does, and set `grades_groups`)."""

    type: ClassVar[str]
    fields: ClassVar[dict[str, Field]] = {}
    grades_groups: ClassVar[bool] = False
    # The error code of a reward that is not finite or falls outside `reward_range()`.
    reward_error_code: ClassVar[str] = "grader_internal_error"

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        """`spec` must already be normalised by `validate` (use `registry.build_grader`)."""
        self.spec = spec
        self.runtime = runtime or GraderRuntime()
        self.name: str = spec["name"]
        self.error_reward: float = spec["error_reward"]

    @classmethod
    def validate(cls, spec: Any, path: str = "grader") -> dict[str, Any]:
        """Return the spec with defaults filled in, or raise GraderSpecError with every problem."""
        if not isinstance(spec, dict):
            raise GraderSpecError([{"path": path, "message": "must be an object"}])
        fields = {**COMMON_FIELDS, **cls.fields}
        problems = [
            {"path": f"{path}.{key}", "message": names.unknown("field", str(key), fields, quoted=False)}
            for key in spec
            if key not in fields
        ]
        normalised: dict[str, Any] = {}
        for key, spec_field in fields.items():
            field_path = f"{path}.{key}"
            if key not in spec:
                if spec_field.required:
                    problems.append({"path": field_path, "message": "is required"})
                elif key == "name":
                    normalised[key] = cls.type
                elif spec_field.default is not None:
                    normalised[key] = _normalise(spec_field.kind, spec_field.default)
                continue
            value = spec[key]
            field_problems = _field_problems(spec_field, value, field_path)
            problems += field_problems
            if not field_problems:
                normalised[key] = _normalise(spec_field.kind, value)
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
        """Extra checks beyond field types; `spec` holds only the fields that passed. It may also
        normalise further (fill in values that depend on other fields)."""
        return []

    def grade(self, sample: Sample, item: dict[str, Any]) -> GradeResult:
        started = time.perf_counter()
        return self.result(attempt(self.score, sample, item), started)

    def grade_batch(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        """Grade samples[i] against items[i], each on its own."""
        return [self.grade(sample, item) for sample, item in zip(samples, items, strict=True)]

    def grade_group(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        """Grade one group of samples (all answers to one task); per sample unless overridden."""
        return self.grade_batch(samples, items)

    def reward_range(self) -> tuple[float, float] | None:
        """The declared [low, high] of this grader's reward (None: any finite number). A reward
        outside it is an error entry, never a reward: clipping would hide a grader's mistake."""
        return None

    def reward_problem(self, reward: float) -> str | None:
        """Why `reward` cannot be this grader's reward, or None when it can."""
        if not math.isfinite(reward):
            return f"the reward {reward!r} is not a finite number"
        bounds = self.reward_range()
        if bounds is not None and not bounds[0] <= reward <= bounds[1]:
            return f"the reward {reward:g} is outside the declared range [{bounds[0]:g}, {bounds[1]:g}]"
        return None

    def result(self, outcome: float | Score | GradingError, started: float) -> GradeResult:
        """Turn a score or a sample failure into this grader's GradeResult."""
        if not isinstance(outcome, GradingError):
            score = outcome if isinstance(outcome, Score) else Score(float(outcome))
            problem = self.reward_problem(score.reward)
            if problem is not None:
                outcome = GradingError(
                    self.reward_error_code,
                    problem,
                    scores=score.scores,
                    token_usage=score.token_usage,
                    sampled_model_name=score.sampled_model_name,
                )
        if isinstance(outcome, GradingError):
            score = Score(self.error_reward, outcome.scores, outcome.token_usage, outcome.sampled_model_name)
            errors = [{"code": outcome.code, "detail": outcome.detail, "grader": self.name}]
        else:
            score = outcome if isinstance(outcome, Score) else Score(float(outcome))
            errors = []
        return GradeResult(
            reward=score.reward,
            sub_rewards={self.name: score.reward},
            errors=errors,
            execution_time=time.perf_counter() - started,
            name=self.name,
            type=self.type,
            scores=score.scores,
            token_usage=score.token_usage,
            sampled_model_name=score.sampled_model_name,
        )

    @abstractmethod
    def score(self, sample: Sample, item: dict[str, Any]) -> float | Score:
        """The reward for one sample; raise GradingError for a sample that cannot be graded."""


def range_problems(spec: dict[str, Any], path: str) -> list[dict[str, str]]:
    """The check of a `range` field ([min, max], min < max) shared by the graders that declare one."""
    bounds = spec.get("range")
    if bounds is not None and (len(bounds) != 2 or bounds[0] >= bounds[1]):
        return [{"path": f"{path}.range", "message": "must be [min, max] with min < max"}]
    return []


def attempt(score: Callable[..., float | Score], *args: Any) -> float | Score | GradingError:
    """Call a scoring function, turning any failure into a GradingError value."""
    try:
        return score(*args)
    except GradingError as error:
        return error
    except SlotsBusy:
        raise  # the host is full, not this sample's doing: the caller queues or answers 429
    except Exception as error:  # a bug in a grader must not stop a training step either
        return GradingError("grader_internal_error", f"{type(error).__name__}: {error}")


def _field_problems(spec_field: Field, value: Any, path: str) -> list[dict[str, str]]:
    if not _has_kind(value, spec_field.kind):
        return [{"path": path, "message": f"must be {KIND_WORDS[spec_field.kind]}"}]
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


# Every grader type by its ``type`` name. training.rewards.registry imports every grader and fills
# it; a composite grader (multi, ruler) validates and builds its parts from it.
GRADER_TYPES: dict[str, type[Grader]] = {}


def validate_grader(spec: Any, path: str = "grader") -> dict[str, Any]:
    """Return the normalised spec (defaults filled in) or raise GraderSpecError with all problems.
    Needs no judge and runs no user code (a python grader's source is only compiled)."""
    if not isinstance(spec, dict):
        raise GraderSpecError([{"path": path, "message": "must be an object"}])
    if "type" not in spec:
        raise GraderSpecError([{"path": f"{path}.type", "message": "is required"}])
    grader_type = spec["type"]
    if not isinstance(grader_type, str) or grader_type not in GRADER_TYPES:
        allowed = ", ".join(GRADER_TYPES)
        message = f"must be one of {allowed}"
        suggestion = names.closest(grader_type, GRADER_TYPES) if isinstance(grader_type, str) else None
        if suggestion:
            message += f"; did you mean {suggestion}?"
        raise GraderSpecError([{"path": f"{path}.type", "message": message}])
    return GRADER_TYPES[grader_type].validate(spec, path)
