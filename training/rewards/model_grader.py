"""What the LLM-judge graders (`score_model`, `label_model`) share: the `model`, `input` and
`sampling_params` fields, rendering the input messages, the injected judge client, concurrent
judge calls over a batch, and recognising a refusal.

    "input": [{"role": "system", "content": "Grade the answer from 0 to 1. Reply with the number."},
              {"role": "user", "content": "Reference: {{item.answer}}\\nAnswer: {{sample.output_text}}"}]

Message contents are templates. `developer` messages are sent as `system` (not every
OpenAI-compatible server knows the developer role)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GradeResult, GraderRuntime, Sample
from training.rewards.errors import GraderSetupError
from training.rewards.judge import JudgeClient, JudgeReply, sampling_params_problems
from training.rewards.templates import Template, TemplateSyntaxError

ROLES = ("system", "developer", "user", "assistant")
# A reply that opens like this and holds nothing parseable is a refusal, not a malformed answer.
REFUSAL_OPENING = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry,|i can'?t|i cannot|i can not|i won'?t|i will not|i'?m unable|"
    r"i am unable|i'?m not able|i am not able|as an ai)",
    re.IGNORECASE,
)

MODEL_FIELDS: dict[str, Field] = {
    "model": Field("string", required=True),
    "input": Field("list", required=True),
    "sampling_params": Field("object", default={}),
}


def messages_problems(messages: list[Any], path: str) -> list[dict[str, str]]:
    if not messages:
        return [{"path": path, "message": "must hold at least one message"}]
    problems = []
    for index, message in enumerate(messages):
        where = f"{path}.{index}"
        if not isinstance(message, dict):
            problems.append({"path": where, "message": "must be an object with role and content"})
            continue
        for key in message:
            if key not in ("role", "content", "type"):
                problems.append({"path": f"{where}.{key}", "message": "unknown field"})
        if message.get("type", "message") != "message":
            problems.append({"path": f"{where}.type", "message": "must be 'message'"})
        if message.get("role") not in ROLES:
            problems.append({"path": f"{where}.role", "message": f"must be one of {', '.join(ROLES)}"})
        content = message.get("content")
        if not isinstance(content, str):
            problems.append({"path": f"{where}.content", "message": "must be a string (a template)"})
            continue
        try:
            Template.parse(content)
        except TemplateSyntaxError as error:
            problems.append({"path": f"{where}.content", "message": str(error)})
    return problems


def require_judge(runtime: GraderRuntime, grader_type: str, name: str) -> JudgeClient:
    if runtime.judge is None:
        raise GraderSetupError(
            f"{grader_type} grader {name!r} needs a judge endpoint: configure one for the team"
        )
    return runtime.judge


def looks_like_refusal(reply: JudgeReply) -> bool:
    return reply.finish_reason == "content_filter" or bool(REFUSAL_OPENING.match(reply.content))


class ModelGrader(Grader):
    """Base of the judge graders: subclasses add fields and implement `score` with `self.ask`."""

    fields: ClassVar[dict[str, Field]] = MODEL_FIELDS

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = []
        if "input" in spec:
            problems += messages_problems(spec["input"], f"{path}.input")
        if "sampling_params" in spec:
            problems += sampling_params_problems(spec["sampling_params"], f"{path}.sampling_params")
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.judge = require_judge(self.runtime, self.type, self.name)
        self.model: str = spec["model"]
        self.messages = [
            (
                "system" if message["role"] == "developer" else message["role"],
                Template.parse(message["content"]),
            )
            for message in spec["input"]
        ]
        self.sampling_params: dict[str, Any] = spec["sampling_params"]

    def ask(self, sample: Sample, item: dict[str, Any]) -> JudgeReply:
        messages = [
            {"role": role, "content": template.render(sample, item)} for role, template in self.messages
        ]
        return self.judge.complete(
            model=self.model, messages=messages, sampling_params=self.sampling_params,
            response_format=self.response_format(),
        )  # fmt: skip

    def response_format(self) -> dict[str, Any] | None:
        """The `response_format` to ask the judge for (None: free text; see training.rewards.judge)."""
        return None

    def grade_batch(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        # Judge calls wait on the network: keep several in flight.
        if len(samples) != len(items):
            raise ValueError(f"got {len(samples)} samples but {len(items)} items")
        workers = max(1, min(self.judge.max_concurrency, len(samples)))
        if workers == 1:
            return super().grade_batch(samples, items)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self.grade, samples, items))


FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)


def json_candidates(text: str) -> Iterator[Any]:
    """JSON values a judge's reply may hold, most explicit first: each ```json fenced block, the
    whole reply, then the span from the first '{' to the last '}'. Unparsable candidates are skipped."""
    candidates = [match.group(1) for match in FENCE.finditer(text)] + [text]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    for candidate in candidates:
        try:
            yield json.loads(candidate)
        except ValueError:
            continue
