"""Scenario generation: an LLM writes task rows for an environment's tools, we keep the valid ones.

No Django here. The model is any OpenAI-compatible endpoint (``training.rollouts.remote.ChatEndpoint``): a
team-configured endpoint, or our own gateway serving a checkpoint. Rows are requested in small
batches as a JSON array (JSON Lines and fenced code blocks are accepted too); every candidate row is
checked by the caller's ``validate`` (the task-set upload rules) and against the rows already kept.
Failures (an endpoint error, malformed JSON, a missing field, a duplicate) are reported per row in
the report, never raised: the caller decides what to do with what was accepted.

Bounded by design: at most ``MAX_ROWS`` rows, ``max_requests`` calls and ``deadline_s`` seconds.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from training.rollouts.remote import ChatEndpoint, EndpointError
from training.rollouts.strict_json import loads_lenient

MAX_ROWS = 100
BATCH_SIZE = 10
MAX_ERRORS_KEPT = 200
# Prompts already written, shown to the model so it does not repeat them (the most recent ones).
SHOWN_PROMPTS = 20

Validator = Callable[[Any], list[tuple[str, str]]]  # row -> [(field, message)], [] when valid

SYSTEM_PROMPT = (
    "You write task rows for training and evaluating an AI agent. Reply with a JSON array only, "
    "no prose and no code fences."
)


@dataclass
class RowError:
    request: int  # which request (1-based) produced it
    row: int | None  # position in that reply (1-based); None for a whole-reply failure
    error: str
    field: str = ""


@dataclass
class ScenarioReport:
    requested: int
    model: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    requests: int = 0
    candidates: int = 0
    stopped: str = ""  # why generation stopped short of `requested` ("" when it did not)
    seconds: float = 0.0

    @property
    def accepted(self) -> int:
        return len(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """The report as stored in ``TaskSet.source`` (rows excluded: they are the task set)."""
        return {
            "requested": self.requested,
            "accepted": self.accepted,
            "rejected": self.candidates - self.accepted,
            "model": self.model,
            "requests": self.requests,
            "stopped": self.stopped,
            "seconds": round(self.seconds, 3),
            "errors": [asdict(error) for error in self.errors[:MAX_ERRORS_KEPT]],
            "errors_truncated": len(self.errors) > MAX_ERRORS_KEPT,
        }


def basic_row_problems(row: Any) -> list[tuple[str, str]]:
    """The least a row needs (the platform's full rules are passed in by the caller)."""
    if not isinstance(row, dict):
        return [("", "must be a JSON object")]
    if not isinstance(row.get("prompt"), str) and not isinstance(row.get("messages"), list):
        return [("prompt", "give 'prompt' (a string) or 'messages'")]
    return []


def generation_messages(
    *,
    tools: list[dict[str, Any]],
    instruction: str,
    count: int,
    environment: str = "",
    system_prompt: str = "",
    avoid: list[str] | None = None,
) -> list[dict[str, str]]:
    tool_text = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools) if tools else "(no tools)"
    parts = [
        f"Environment: {environment or 'chat'}.",
        f"The agent's system prompt: {system_prompt!r}." if system_prompt else "",
        f"Tools the agent can call (OpenAI JSON schemas):\n{tool_text}",
        f"What the tasks should be: {instruction.strip()}",
        f"Write {count} different task rows as a JSON array. Each row is an object with exactly these keys:",
        '  "prompt": the user\'s request to the agent (a string);',
        '  "item": an object with the values a grader checks the answer against, e.g. {"answer": "42"}.',
        "Tasks must be answerable with the tools above; do not include the answer in the prompt.",
    ]
    if avoid:
        parts.append("Do not repeat these prompts:\n" + "\n".join(f"- {prompt}" for prompt in avoid))
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "\n".join(part for part in parts if part)},
    ]


_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def parse_candidates(text: str) -> tuple[list[Any], list[tuple[int | None, str]]]:
    """Candidate rows from a reply, and (position, error) for the parts that are not JSON.

    Accepted shapes: a JSON array of rows, ``{"rows": [...]}``, one row object, or JSON Lines
    (one row per line, where a malformed line is an error for that row only)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    if not body:
        return [], [(None, "the reply is empty")]
    try:
        value = loads_lenient(body)
    except json.JSONDecodeError:
        value = None
    else:
        if isinstance(value, list):
            return value, []
        if isinstance(value, dict) and isinstance(value.get("rows"), list):
            return value["rows"], []
        return [value], []
    candidates: list[Any] = []
    errors: list[tuple[int | None, str]] = []
    lines = [line.strip().rstrip(",") for line in body.splitlines()]
    lines = [line for line in lines if line and line not in ("[", "]")]
    for position, line in enumerate(lines, start=1):
        try:
            candidates.append(loads_lenient(line))
        except json.JSONDecodeError as exc:
            candidates.append(_Malformed(f"malformed JSON: {exc.msg} (column {exc.colno})"))
            errors.append((position, candidates[-1].error))
    return candidates, errors


@dataclass
class _Malformed:
    error: str


def _key(row: dict[str, Any]) -> str:
    """Two rows are duplicates when they ask the same thing: same prompt/messages, ignoring case
    and spacing (a different `item` for the same prompt is a contradiction, not a new task)."""
    asked = row.get("prompt") if "prompt" in row else row.get("messages")
    text = asked if isinstance(asked, str) else json.dumps(asked, sort_keys=True, ensure_ascii=False)
    return " ".join(text.lower().split())


def _asked(row: dict[str, Any]) -> str:
    if isinstance(row.get("prompt"), str):
        return row["prompt"][:200]
    return json.dumps(row.get("messages"), ensure_ascii=False)[:200]


def generate_rows(
    endpoint: ChatEndpoint,
    model: str,
    *,
    tools: list[dict[str, Any]],
    instruction: str,
    n: int,
    validate: Validator = basic_row_problems,
    environment: str = "",
    system_prompt: str = "",
    batch_size: int = BATCH_SIZE,
    max_requests: int | None = None,
    deadline_s: float = 120.0,
    temperature: float = 0.7,
    max_tokens: int = 4096,
    on_progress: Callable[[ScenarioReport], None] | None = None,
) -> ScenarioReport:
    """Ask ``model`` for ``n`` rows in batches until ``n`` are accepted, the requests run out
    (default: the batches needed plus two retries) or ``deadline_s`` passes. ``on_progress`` is
    called with the report so far after each request (a background job shows rows accepted / n)."""
    if not 1 <= n <= MAX_ROWS:
        raise ValueError(f"n must be from 1 to {MAX_ROWS}")
    batches = math.ceil(n / batch_size)
    max_requests = max_requests if max_requests is not None else batches + 2
    report = ScenarioReport(requested=n, model=model)
    seen: dict[str, int] = {}
    started = time.monotonic()
    while report.accepted < n:
        if report.requests >= max_requests:
            report.stopped = f"stopped after {report.requests} requests"
            break
        if time.monotonic() - started > deadline_s:
            report.stopped = f"stopped after {deadline_s:g} s"
            break
        report.requests += 1
        request = report.requests
        count = min(batch_size, n - report.accepted)
        messages = generation_messages(
            tools=tools,
            instruction=instruction,
            count=count,
            environment=environment,
            system_prompt=system_prompt,
            avoid=[_asked(row) for row in report.rows[-SHOWN_PROMPTS:]],
        )
        try:
            reply = endpoint.chat(
                model=model, messages=messages, temperature=temperature, max_tokens=max_tokens, seed=request
            )
        except EndpointError as exc:
            report.errors.append(RowError(request, None, str(exc)))
            if on_progress is not None:
                on_progress(report)
            continue
        candidates, _ = parse_candidates(reply.content)
        if not candidates:
            report.errors.append(RowError(request, None, "the reply holds no rows"))
        for position, candidate in enumerate(candidates, start=1):
            report.candidates += 1
            if isinstance(candidate, _Malformed):
                report.errors.append(RowError(request, position, candidate.error))
                continue
            problems = validate(candidate)
            if problems:
                where, message = problems[0]
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                report.errors.append(RowError(request, position, f"{message}{more}", where))
                continue
            key = _key(candidate)
            if key in seen:
                report.errors.append(
                    RowError(request, position, f"duplicate of accepted row {seen[key] + 1}", "prompt")
                )
                continue
            if report.accepted >= n:
                report.errors.append(RowError(request, position, f"more rows than the {n} requested"))
                continue
            seen[key] = report.accepted
            report.rows.append(candidate)
        if on_progress is not None:
            on_progress(report)
    report.seconds = time.monotonic() - started
    return report
