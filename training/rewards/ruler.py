"""`ruler` (ours): a relative judge over a whole group, after OpenPipe ART's RULER method.

    {"type": "ruler", "model": "gpt-4o-mini", "rubric": "Prefer answers that ...",
     "sampling_params": {"temperature": 0}, "original_grader": {"type": "string_check", ...}}

GRPO only needs rewards that rank a group's samples against each other, and a judge ranks several
attempts at one task more reliably than it scores one in isolation. So one judge call per group:
the messages every trajectory shares (the prompt, usually) are sent once as context, then each
trajectory's own remaining messages under an id, and the judge answers JSON
`{"scores": [{"trajectory_id": "1", "explanation": "...", "score": 0.8}, ...]}` with each score in
[0, 1] against the rubric (`rubric` is a template that may use `{{item...}}`, rendered with the
group's first item). The reward is that score. That shape is also sent as the request's
`response_format` (a strict JSON schema), so an endpoint with constrained decoding cannot answer
anything else; one that refuses the field is asked again without it.

Errors, per trajectory: a reply that is not that JSON (or a refusal) flags every trajectory of the
group with `model_grader_parse_error`; a missing id, a non-numeric score or one outside [0, 1]
flags that trajectory only. `original_grader` (optional, any grader that grades samples one by
one) is kept as a metric: its reward is in `sub_rewards` under its name and in
`scores["original_reward"]`, and its own errors in `scores["original_errors"]`, not in `errors`
(a metric that fails does not fail the sample). The call's token usage is recorded on the group's
first result only, so that summing over results counts it once.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, ClassVar

from training.rewards.base import (
    GRADER_TYPES,
    Field,
    Grader,
    GradeResult,
    GraderRuntime,
    Sample,
    Score,
    validate_grader,
)
from training.rewards.errors import GraderSpecError, GradingError
from training.rewards.judge import sampling_params_problems
from training.rewards.model_grader import json_candidates, looks_like_refusal, require_judge
from training.rewards.templates import Template, TemplateSyntaxError

PARSE_ERROR = "model_grader_parse_error"

DEFAULT_RUBRIC = """\
- A trajectory that reaches the task's goal scores clearly higher than one that does not.
- Between two that reach it, the more direct one (fewer wasted steps, no needless detours) scores higher.
- Partial progress toward the goal earns partial credit.
- Make score gaps proportional to quality gaps: near-equal trajectories get near-equal scores."""

SYSTEM_PROMPT = """\
You compare several attempts (trajectories) at the same task and score each from 0 to 1 against \
the rubric below. Judge them relative to one another. The messages they all share come first, in \
<context>; each trajectory's own messages follow in <trajectory id="...">.

Rubric:
{rubric}

Reply with JSON only, one entry per trajectory:
{{"scores": [{{"trajectory_id": "1", "explanation": "one or two sentences", "score": 0.0}}]}}"""


class RulerGrader(Grader):
    type: ClassVar[str] = "ruler"
    grades_groups: ClassVar[bool] = True
    fields: ClassVar[dict[str, Field]] = {
        "model": Field("string", required=True),
        "rubric": Field("string", default=DEFAULT_RUBRIC, template=True),
        "sampling_params": Field("object", default={}),
        "original_grader": Field("object"),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = []
        if "sampling_params" in spec:
            problems += sampling_params_problems(spec["sampling_params"], f"{path}.sampling_params")
        if "rubric" in spec:
            try:
                template = Template.parse(spec["rubric"])
            except TemplateSyntaxError:
                template = None  # reported by the field check
            if template is not None and any(variable[0] != "item" for variable in template.variables):
                problems.append({"path": f"{path}.rubric", "message": "may only use {{item...}} variables"})
        if "original_grader" in spec:
            where = f"{path}.original_grader"
            original_type = spec["original_grader"].get("type")
            if isinstance(original_type, str) and getattr(
                GRADER_TYPES.get(original_type), "grades_groups", False
            ):
                problems.append(
                    {"path": f"{where}.type", "message": f"{original_type} cannot be an original_grader"}
                )
            else:
                try:
                    spec["original_grader"] = validate_grader(spec["original_grader"], where)
                except GraderSpecError as error:
                    problems += error.problems
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.judge = require_judge(self.runtime, self.type, self.name)
        self.model: str = spec["model"]
        self.rubric = Template.parse(spec["rubric"])
        self.sampling_params: dict[str, Any] = spec["sampling_params"]
        original = spec.get("original_grader")
        self.original: Grader | None = (
            GRADER_TYPES[original["type"]](original, self.runtime) if original is not None else None
        )

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        return self.grade(sample, item).reward

    def grade(self, sample: Sample, item: dict[str, Any]) -> GradeResult:
        return self.grade_group([sample], [item])[0]

    def grade_batch(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        raise ValueError(
            "ruler compares the samples of one group: grade with grade_group, one group at a time"
        )

    def grade_group(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        if len(samples) != len(items):
            raise ValueError(f"got {len(samples)} samples but {len(items)} items")
        if not samples:
            return []
        started = time.perf_counter()
        originals = self.original.grade_batch(samples, items) if self.original is not None else None
        outcomes: list[Score | GradingError]
        try:
            outcomes = list(self._judge_group(samples, items[0]))
        except GradingError as error:
            outcomes = [error] * len(samples)
        elapsed = (time.perf_counter() - started) / len(samples)
        results = []
        for index, outcome in enumerate(outcomes):
            if index > 0:  # the one call's usage counts once, on the first result
                if isinstance(outcome, Score):
                    outcome = Score(outcome.reward, outcome.scores, {}, outcome.sampled_model_name)
                else:
                    outcome = GradingError(
                        outcome.code,
                        outcome.detail,
                        sampled_model_name=outcome.sampled_model_name,
                        scores=outcome.scores,
                    )
            result = self.result(outcome, time.perf_counter())
            result.execution_time = elapsed
            if originals is not None:
                original = originals[index]
                result.sub_rewards[original.name] = original.reward
                result.scores = {**result.scores, "original_reward": original.reward}
                if original.errors:
                    result.scores["original_errors"] = original.errors
            results.append(result)
        return results

    def _judge_group(self, samples: list[Sample], item: dict[str, Any]) -> list[Score | GradingError]:
        rubric = self.rubric.render(samples[0], item)
        trajectories = [_trajectory(sample) for sample in samples]
        shared = _shared_prefix(trajectories)
        parts = [
            f"<context>\n{json.dumps(trajectories[0][:shared], ensure_ascii=False)}\n</context>\n\nTrajectories:"
        ]
        for number, messages in enumerate(trajectories, start=1):
            parts.append(
                f'<trajectory id="{number}">\n{json.dumps(messages[shared:], ensure_ascii=False)}\n</trajectory>'
            )
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric)},
            {"role": "user", "content": "\n\n".join(parts)},
        ]
        reply = self.judge.complete(
            model=self.model, messages=messages, sampling_params=self.sampling_params,
            response_format=scores_response_format(len(samples)),
        )  # fmt: skip
        spent: dict[str, Any] = {
            "token_usage": reply.token_usage,
            "sampled_model_name": reply.sampled_model_name,
        }
        if reply.refusal:
            raise GradingError(PARSE_ERROR, f"refusal: {reply.refusal[:200]}", **spent)
        scores = _parse_scores(reply.content)
        if scores is None:
            if looks_like_refusal(reply):
                raise GradingError(PARSE_ERROR, f"refusal: {reply.content[:200]}", **spent)
            raise GradingError(
                PARSE_ERROR,
                f'the reply is not JSON of the form {{"scores": [...]}}: {reply.content[:200]!r}',
                **spent,
            )
        outcomes: list[Score | GradingError] = []
        for number in range(1, len(samples) + 1):
            entry = scores.get(str(number))
            if entry is None:
                outcomes.append(
                    GradingError(PARSE_ERROR, f"the reply has no score for trajectory {number}", **spent)
                )
                continue
            value, explanation = entry
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                outcomes.append(
                    GradingError(
                        PARSE_ERROR, f"trajectory {number}: score {value!r} is not a number", **spent
                    )
                )
            elif not 0.0 <= value <= 1.0:
                outcomes.append(
                    GradingError(
                        PARSE_ERROR, f"trajectory {number}: score {value:g} is outside [0, 1]", **spent
                    )
                )
            else:
                details = {"explanation": explanation[:500]} if explanation else {}
                outcomes.append(Score(float(value), details, **spent))
        return outcomes


def scores_response_format(count: int) -> dict[str, Any]:
    """The reply's JSON schema, sent as `response_format` as ART's RULER does (an endpoint that
    cannot honour it is asked without it, training.rewards.judge): one entry per trajectory, ids
    "1".."count", scores in [0, 1]."""
    entry = {
        "type": "object",
        "properties": {
            "trajectory_id": {"type": "string", "enum": [str(number) for number in range(1, count + 1)]},
            "explanation": {"type": "string"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": entry, "minItems": count, "maxItems": count}},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


def _trajectory(sample: Sample) -> list[dict[str, Any]]:
    messages = [message for message in sample.messages if isinstance(message, dict)]
    if not messages or (messages[-1].get("role") != "assistant" and sample.output_text):
        messages.append({"role": "assistant", "content": sample.output_text})
    return messages


def _shared_prefix(trajectories: list[list[dict[str, Any]]]) -> int:
    """How many leading messages every trajectory shares, leaving each at least its last one."""
    limit = min(len(messages) for messages in trajectories) - 1
    length = 0
    while length < limit and all(messages[length] == trajectories[0][length] for messages in trajectories):
        length += 1
    return length


def _parse_scores(text: str) -> dict[str, tuple[Any, str]] | None:
    """{trajectory id: (score, explanation)} from the judge's reply, or None if it is unreadable.
    Accepts `{"scores": [{"trajectory_id", "score", "explanation"}]}` and `{"scores": {"1": 0.5}}`."""
    for data in json_candidates(text):
        entries = data.get("scores") if isinstance(data, dict) else None
        if isinstance(entries, dict):
            return {str(key): (value, "") for key, value in entries.items()}
        if isinstance(entries, list):
            parsed: dict[str, tuple[Any, str]] = {}
            for entry in entries:
                if isinstance(entry, dict) and "trajectory_id" in entry:
                    explanation = entry.get("explanation")
                    parsed.setdefault(
                        str(entry["trajectory_id"]),
                        (entry.get("score"), explanation if isinstance(explanation, str) else ""),
                    )
            return parsed
    return None
