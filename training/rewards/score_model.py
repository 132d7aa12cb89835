"""`score_model`: an LLM judge gives a number, compatible with OpenAI's grader of that name.

    {"type": "score_model", "name": "judge", "model": "gpt-4o-mini",
     "input": [{"role": "user", "content": "Score 0 to 1 ... {{sample.output_text}}"}],
     "range": [0, 1], "sampling_params": {"temperature": 0}, "pass_threshold": 0.5}

The reward is the judge's score, or 1/0 against `pass_threshold` when one is given. The reply is
read as, in order: JSON (a number, or an object with a numeric `score`/`result`/`grade`/`rating`,
possibly inside a ```json fence or surrounding text), a bare number, or a "score: 7" phrase. Any
other reply is a `model_grader_parse_error`; so is a refusal (detail starting "refusal").

`"response_format": "json_schema"` (ours; the default "text" sends none) asks the judge for
`{"score": <number in range>}` through the request's `response_format`, so a judge with constrained
decoding (artweb's own gateway, vLLM) can only answer a readable score; an endpoint that refuses
the field is asked again without it (training.rewards.judge).

A score outside `range` is an error, not clipped: a judge that answers 7 on a 0..1 scale has
misread the scale, and clipping would silently turn that into a perfect reward. `range` bounds the
judge's score, checked here (with `pass_threshold` the reward is then 1 or 0, whatever the range);
`Grader.result` refuses a non-finite reward as for every grader.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from training.rewards.base import Field, GraderRuntime, Sample, Score, range_problems
from training.rewards.errors import GradingError
from training.rewards.judge import JudgeReply
from training.rewards.model_grader import MODEL_FIELDS, ModelGrader, json_candidates, looks_like_refusal

PARSE_ERROR = "model_grader_parse_error"
SCORE_KEYS = ("score", "result", "grade", "rating")
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
BARE_NUMBER = re.compile(rf"\s*({NUMBER})\s*[.!]?\s*")
SCORE_PHRASE = re.compile(
    rf"\b(?:score|rating|grade|result)\s*(?:is|of)?\s*[:=]?\s*\**\s*({NUMBER})", re.IGNORECASE
)


class ScoreModelGrader(ModelGrader):
    type: ClassVar[str] = "score_model"
    fields: ClassVar[dict[str, Field]] = {
        **MODEL_FIELDS,
        "range": Field("number_list", default=[0.0, 1.0]),
        "pass_threshold": Field("number"),
        "response_format": Field("string", default="text", choices=("text", "json_schema")),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        return super().check_spec(spec, path) + range_problems(spec, path)

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.low, self.high = spec["range"]
        self.pass_threshold: float | None = spec.get("pass_threshold")
        self.json_reply = spec.get("response_format", "text") == "json_schema"

    def response_format(self) -> dict[str, Any] | None:
        if not self.json_reply:
            return None
        score = {"type": "number", "minimum": self.low, "maximum": self.high}
        schema = {
            "type": "object",
            "properties": {"score": score},
            "required": ["score"],
            "additionalProperties": False,
        }
        return {"type": "json_schema", "json_schema": {"name": "score", "schema": schema, "strict": True}}

    def score(self, sample: Sample, item: dict[str, Any]) -> Score:
        reply = self.ask(sample, item)
        spent: dict[str, Any] = {
            "token_usage": reply.token_usage,
            "sampled_model_name": reply.sampled_model_name,
        }
        value = parse_score_reply(reply)
        if not self.low <= value <= self.high:
            raise GradingError(
                PARSE_ERROR,
                f"score {value:g} is outside the range [{self.low:g}, {self.high:g}]",
                scores={"score": value},
                **spent,
            )
        reward = value if self.pass_threshold is None else float(value >= self.pass_threshold)
        return Score(reward, {"score": value}, **spent)


def parse_score_reply(reply: JudgeReply) -> float:
    spent: dict[str, Any] = {"token_usage": reply.token_usage, "sampled_model_name": reply.sampled_model_name}
    if reply.refusal:
        raise GradingError(PARSE_ERROR, f"refusal: {reply.refusal[:200]}", **spent)
    value = parse_score(reply.content)
    if value is None:
        if looks_like_refusal(reply):
            raise GradingError(PARSE_ERROR, f"refusal: {reply.content[:200]}", **spent)
        raise GradingError(PARSE_ERROR, f"no score in the judge's reply: {reply.content[:200]!r}", **spent)
    return value


def parse_score(text: str) -> float | None:
    """The score in a judge's reply, or None when there is none (see the module docstring)."""
    for data in json_candidates(text):
        value = _number_in(data)
        if value is not None:
            return value
    match = BARE_NUMBER.fullmatch(text)
    if match is None:
        phrases = SCORE_PHRASE.findall(text)
        if not phrases:
            return None
        return _finite(float(phrases[-1]))
    return _finite(float(match.group(1)))


def _number_in(data: Any) -> float | None:
    if isinstance(data, bool):
        return None
    if isinstance(data, int | float):
        return _finite(float(data))
    if isinstance(data, dict):
        for key in SCORE_KEYS:
            value = data.get(key)
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                return _finite(float(value))
    return None


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
