"""`endpoint`: the team's own HTTP service grades the whole trace (OpenAI's Agent RFT "endpoint
grader"). Usable alone or inside `multi`.

    {"type": "endpoint", "name": "checker", "url": "https://grader.example.com/grade",
     "headers": {"Authorization": "Bearer …"}, "timeout_s": 10, "retries": 2, "max_concurrency": 16}

Fields: `url` (http or https; checked by the operator's outbound policy when written and again at
every connection), `headers` (sent with every call: HTTP header names and one-line string values of
at most 8192 characters, not Host, Content-Length, Transfer-Encoding or Connection, the rule of MCP
servers' and http tools' headers too, ``training.wire.headers``; values are secrets, see below), `timeout_s` (seconds per attempt, default 10, at most 120), `retries` (extra attempts
after a timeout, a connection error or a 408/409/429/5xx answer; default 2, at most 5; backoff
0.5 s doubled), `max_concurrency` (calls in flight when a step's samples are graded, default 16,
at most 64), plus every grader's `name` and `error_reward`.

Request: `POST url` with a JSON body

    {"grader": "checker",
     "sample": {"output_text", "output_json", "output_tools", "messages", "outcome"},
     "item": {...the task row's item...},
     "ids": {"step": 3, "draw": 0, "group": 0, "rollout": 1, "row_index": 12}}

`sample` is the python grader's `sample` (OpenAI's shape): `messages` is the whole transcript with
the assistant's `tool_calls` and the `tool` messages' outputs, `output_tools` the calls. `ids` holds
what the caller knows (in a run: the step being trained, starting at 1, dynamic sampling's `draw`
within it, the group and the rollout within the group, the task row's index; `{}` for a one-off
`graders/run`).

Reply: `{"reward": x}` or a bare number `x`, with `0 <= x <= 1` (a boolean is not a number). A reply
read beyond 64 KiB is refused. Anything else is an error entry on that sample (its `error_reward`,
never a crash), counted per code in the step's `grader_errors.<code>` metrics and quoted in the
run's failure when too many samples fail (`training.rewards.registry.grade_trajectories`):
- `endpoint_grader_timeout` (OpenAI's flag `unresponsive_reward_error`): no answer within
  `timeout_s`, on the last attempt;
- `endpoint_grader_server_error`: an HTTP error status, an unreachable host, a host or a redirect the
  outbound policy refuses, a reply over the size cap;
- `endpoint_grader_parse_error`: a reply that is not JSON, holds no numeric `reward`, or a reward
  outside [0, 1] (never clipped: that would hide the endpoint's mistake).
Messages never hold the URL, the headers or an echo of the reply (training.wire.openai_http).

Secrets: header values usually carry a credential. A reward definition (and so a fine-tuning job's
grader) stores them only as Fernet ciphertext and shows them masked, with the same functions that
keep an MCP server's `config.headers` write-only (`projects.environment_config`, applied to every
endpoint node of a spec by `projects.grader_secrets`): a spec node has the same `url` + `headers`
shape, and the same rule holds: a stored value is sent only to the URL it was entered for, and a
masked value written back keeps the stored one. A per-team table like the judge endpoints' was not
chosen: an endpoint grader's URL and headers belong to one grader version, and a versioned reward
definition that pointed at a mutable row could change what an old run's grader called. This module
sees plaintext only in memory, as graders see every setting: from their caller.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar
from urllib.parse import urlsplit

from training.rewards.base import Field, Grader, GradeResult, Sample, is_number
from training.rewards.errors import GradingError
from training.safety.outbound import OutboundRefused, ascii_url
from training.wire.headers import MAX_HEADER_VALUE_CHARS, HeaderProblem, header_problem
from training.wire.openai_http import ChatCompletionError, post_json

TIMEOUT = "endpoint_grader_timeout"
SERVER_ERROR = "endpoint_grader_server_error"
PARSE_ERROR = "endpoint_grader_parse_error"
MAX_REPLY_BYTES = 64 * 1024  # a reward needs a few bytes; a larger reply is a misbehaving endpoint
MAX_TIMEOUT_S = 120.0
MAX_RETRIES = 5
MAX_CONCURRENCY = 64
RETRY_BACKOFF_S = 0.5
HEADER_MESSAGES: dict[HeaderProblem, str] = {
    "not_string": "must be a string",
    "reserved": "is set by the HTTP client",
    "name": f"must be a header name and one line of at most {MAX_HEADER_VALUE_CHARS} characters",
    "value": f"must be a header name and one line of at most {MAX_HEADER_VALUE_CHARS} characters",
}


class EndpointGrader(Grader):
    type: ClassVar[str] = "endpoint"
    fields: ClassVar[dict[str, Field]] = {
        "url": Field("string", required=True),
        "headers": Field("object", default={}),
        "timeout_s": Field("number", default=10.0),
        "retries": Field("number", default=2),
        "max_concurrency": Field("number", default=16),
    }
    reward_error_code: ClassVar[str] = PARSE_ERROR

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = []
        if "url" in spec:
            try:  # the scheme and the form only: the operator's policy judges the host (projects.outbound)
                spec["url"] = ascii_url(spec["url"])
                parts = urlsplit(spec["url"])
                if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
                    raise OutboundRefused("must be an http:// or https:// URL")
            except (OutboundRefused, ValueError) as error:
                problems.append({"path": f"{path}.url", "message": str(error)})
        for name, value in (spec.get("headers") or {}).items():  # the MCP and http_tools kinds' rule
            problem = header_problem(name, value)
            if problem is not None:
                problems.append({"path": f"{path}.headers.{name}", "message": HEADER_MESSAGES[problem]})
        if "timeout_s" in spec and not 0 < spec["timeout_s"] <= MAX_TIMEOUT_S:
            problems.append(
                {"path": f"{path}.timeout_s", "message": f"must be more than 0 and at most {MAX_TIMEOUT_S:g}"}
            )
        for key, low, high in (("retries", 0, MAX_RETRIES), ("max_concurrency", 1, MAX_CONCURRENCY)):
            if key in spec:
                value = spec[key]
                if value != int(value) or not low <= value <= high:
                    problems.append(
                        {"path": f"{path}.{key}", "message": f"must be a whole number from {low} to {high}"}
                    )
                else:
                    spec[key] = int(value)
        return problems

    def reward_range(self) -> tuple[float, float] | None:
        return (0.0, 1.0)

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        body = {"grader": self.name, "sample": sample.to_grader_dict(), "item": item, "ids": dict(sample.ids)}
        try:
            reply = post_json(
                self.spec["url"], body, headers=self.spec["headers"], timeout=self.spec["timeout_s"],
                retries=self.spec["retries"], retry_backoff=RETRY_BACKOFF_S, label="grader endpoint",
                outbound=self.runtime.outbound, max_response_bytes=MAX_REPLY_BYTES,
            )  # fmt: skip
        except ChatCompletionError as error:
            code = PARSE_ERROR if error.not_json else TIMEOUT if error.timed_out else SERVER_ERROR
            raise GradingError(code, str(error)) from None
        reward: Any = reply.get("reward") if isinstance(reply, dict) else reply
        if not is_number(reward):
            raise GradingError(
                PARSE_ERROR, 'grader endpoint must answer {"reward": <number in [0, 1]>} or a bare number'
            )
        return float(reward)

    def grade_batch(self, samples: list[Sample], items: list[dict[str, Any]]) -> list[GradeResult]:
        # Each call waits on the team's service, not on this host: keep several in flight.
        if len(samples) != len(items):
            raise ValueError(f"got {len(samples)} samples but {len(items)} items")
        workers = max(1, min(self.spec["max_concurrency"], len(samples)))
        if workers == 1:
            return super().grade_batch(samples, items)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self.grade, samples, items))
