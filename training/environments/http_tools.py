"""`http_tools`: tools that are the team's own HTTP endpoints (OpenAI's Agent RFT).

    {"kind": "http_tools", "max_turns": 6, "tool_timeout_s": 10,
     "config": {"tools": [{"name": "search", "description": "Search the catalogue.",
                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                           "server_url": "https://tools.example.com/search",
                           "headers": {"Authorization": "Bearer ..."}}],
                "max_tool_calls": 100000}}

Every call the model makes is one POST to its tool's `server_url` (its episode's calls of a turn
all at once, as every tool environment runs them):

    X-Rollout-Id: rollout_<32 hex>   one per episode: every call of an episode carries the same
    X-Call-Id: call_<turn>_<index>   the call's tool_call_id in the trajectory (unique per episode)
    <the tool's headers>             stored encrypted by the platform, decrypted only to build this
    {"rollout_id": ..., "call_id": ..., "name": "search", "arguments": {...}, "item": {...}}

`item` is the task row's item (a fine-tuning file's fields beside `messages`): it is in memory
already, small, and lets an endpoint set up a task's own state without a lookup of its own.

The reply becomes the tool message the model reads: a JSON object's `output` (a string as it is,
anything else as JSON); a JSON object with `error` and no `output` is a tool error; other JSON is
shown as JSON, a body that is not JSON as its text. A failure is a tool message `{"error": ...}`,
never an exception in the loop: a host the outbound policy refuses, a non-2xx answer (connection
errors, 408/409/429 and 5xx are retried `config.max_retries` times, 0.25 s then doubled, with the
same call id, so an endpoint can tell a retry from a new call; a timed-out call is not sent again), a reply
over `config.max_response_bytes`, no answer within the environment's `tool_timeout_s` (counted in
`tool_timeouts`, all else in `tool_errors`), or a spent budget: `config.max_tool_calls` calls per
environment instance (a run, a job, an evaluation), across all its episodes; a call over it is not
sent. Per episode, `metrics` adds `tool_endpoint_calls`, `tool_latency_s` (the calls' durations
summed), `tool_latency_mean_s`, `tool_wait_s` (how long its turns waited for their calls) and
`tool_budget_refused`; `outcome` holds the rollout id and each call's status and latency
(`tool_requests`), which the trajectory viewer shows beside each tool message.

Safety invariant: a team's URL is reached only through the outbound policy (every connection to a
checked address, redirects refused, no proxies: ``training.wire.openai_http.post_json``), and an
error message never holds a header value or the URL.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlparse

from training.environments.base import (
    TOOL_CALLING_ANSWER,
    ConfigError,
    Environment,
    EpisodeState,
    _item,
    _object,
    _turns,
    integer,
    known_keys,
)
from training.environments.mcp import check_headers
from training.rollouts.tools import Tool, ToolCall, ToolResult, run_tool_call_batches
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy, OutboundRefused, ascii_url
from training.wire.openai_http import ChatCompletionError, post_json

CONFIG_HELP = {
    "tools": "the tools: a list of {name, description, parameters (JSON schema object), server_url, "
    "headers (object of strings, optional)}; each call is a POST to its server_url",
    "max_tool_calls": "calls sent per run or job, all episodes together (default 100000); past it a call "
    "answers an error",
    "max_retries": "extra attempts after a connection error, 408/409/429 or 5xx answer (default 2, at most 5)",
    "max_response_bytes": "largest reply read (default 65536, at most 4194304); a larger one is an error",
}
TOOL_KEYS = ("name", "description", "parameters", "server_url", "headers")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 64
MAX_DESCRIPTION_CHARS = 4096
# Set by the environment on every request, besides the framing headers (training.wire.headers); a
# tool's headers may not replace them.
RESERVED_HEADERS = frozenset({"x-rollout-id", "x-call-id", "content-type"})
RETRY_BACKOFF_S = 0.25
DEFAULT_MAX_TOOL_CALLS = 100_000


@dataclass
class _Request:
    """One call sent (or refused) and what became of it, for the episode's metrics and outcome."""

    call_id: str
    name: str
    status: str = "pending"  # "ok", "error", "timeout" or "over_budget"
    latency_s: float = 0.0
    error: str | None = None
    result: ToolResult | None = None

    def record(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"call_id": self.call_id, "name": self.name, "status": self.status,
                                 "latency_ms": round(self.latency_s * 1000, 1)}  # fmt: skip
        if self.error is not None:
            shown["error"] = self.error
        return shown


@dataclass
class _Budget:
    """The instance's calls left: shared by every episode and the threads that run their calls."""

    limit: int
    spent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def take(self) -> bool:
        with self.lock:
            if self.spent >= self.limit:
                return False
            self.spent += 1
            return True


class HttpToolsEnvironment(Environment):
    kind: ClassVar[str] = "http_tools"
    description: ClassVar[str] = (
        "The model may call tools that are your own HTTP endpoints (Agent RFT): each call is a POST "
        "to the tool's server_url with the episode's rollout id and the call id; a turn without a tool "
        "call is its final answer."
    )
    answer: ClassVar[str] = TOOL_CALLING_ANSWER
    default_max_turns: ClassVar[int] = 4
    config_help: ClassVar[dict[str, str]] = CONFIG_HELP
    tools_help: ClassVar[str] = "none here: the tools are defined in config.tools"

    def __init__(self, **settings: Any) -> None:
        self.outbound: OutboundPolicy = settings.pop("outbound", PUBLIC_ONLY)
        super().__init__(**settings)
        self.endpoints: dict[str, dict[str, Any]] = {tool["name"]: tool for tool in self.config["tools"]}
        self.budget = _Budget(int(self.config.get("max_tool_calls", DEFAULT_MAX_TOOL_CALLS)))
        self.max_retries = int(self.config.get("max_retries", 2))
        self.max_response_bytes = int(self.config.get("max_response_bytes", 65536))

    @classmethod
    def validate(cls, config: Any, tools: Any, max_turns: int | None) -> dict[str, Any]:
        config = _object(config, "config")
        known_keys(config, CONFIG_HELP)
        if tools not in (None, []):
            raise ConfigError("tools", "an http_tools environment defines its tools in config.tools")
        listed = config.get("tools")
        if not isinstance(listed, list) or not 1 <= len(listed) <= MAX_TOOLS:
            raise ConfigError("config.tools", f"must be a list of 1 to {MAX_TOOLS} tools")
        config["tools"] = [_tool_config(tool, f"config.tools[{index}]") for index, tool in enumerate(listed)]
        if len({tool["name"] for tool in config["tools"]}) != len(config["tools"]):
            raise ConfigError("config.tools", "tool names must be unique")
        integer(config, "max_tool_calls", DEFAULT_MAX_TOOL_CALLS, minimum=1, maximum=100_000_000)
        integer(config, "max_retries", 2, minimum=0, maximum=5)
        integer(config, "max_response_bytes", 65536, minimum=1024, maximum=4 * 1024 * 1024)
        return {"config": config, "tools": [], "max_turns": _turns(max_turns, cls.default_max_turns)}

    @classmethod
    def tool_arguments(cls, tools: list[Any], config: dict[str, Any]) -> dict[str, Any]:
        return {
            "tools": [Tool(t["name"], t["description"], t["parameters"], _unbound) for t in config["tools"]]
        }

    def start(self, row: dict[str, Any], *, seed: int | None = None) -> EpisodeState:
        state = super().start(row, seed=seed)
        state.data["rollout_id"] = f"rollout_{uuid.uuid4().hex}"
        state.data["requests"] = []
        state.metrics.update(tool_endpoint_calls=0, tool_latency_s=0.0, tool_latency_mean_s=0.0, tool_wait_s=0.0,
                             tool_budget_refused=0)  # fmt: skip
        return state

    def run_calls(self, batches: list[tuple[EpisodeState, list[ToolCall]]]) -> list[list[ToolResult]]:
        """Each runnable call as a batch of its own, with a tool bound to its episode and call id;
        the rest (malformed, unknown tool) through the runner as usual, budget-refused ones at once."""
        planned: list[list[tuple[ToolCall, _Request | None, int | None]]] = []
        singles: list[tuple[list[ToolCall], list[Tool]]] = []
        for state, calls in batches:
            episode: list[tuple[ToolCall, _Request | None, int | None]] = []
            for call in calls:
                if call.error is not None or call.name not in self.endpoints:
                    episode.append((call, None, len(singles)))
                    singles.append(([call], state.tools))
                    continue
                request = _Request(call.id, call.name)
                if not self.budget.take():
                    message = f"the tool-call budget of this job is spent ({self.budget.limit} calls); no call was sent"
                    request.status, request.error = "over_budget", message
                    request.result = ToolResult(json.dumps({"error": message}), error=message)
                    episode.append((call, request, None))
                    continue
                tool = Tool(call.name, "", {}, self._sender(state, call, request))
                episode.append((call, request, len(singles)))
                singles.append(([call], [tool]))
            planned.append(episode)
        started = time.monotonic()
        results = run_tool_call_batches(singles, self.tool_timeout_s)
        waited = time.monotonic() - started
        answers: list[list[ToolResult]] = []
        for (state, _), episode in zip(batches, planned, strict=True):
            episode_results = []
            for _call, sent, single in episode:
                result = results[single][0] if single is not None else None
                if sent is not None:
                    result = self._settle(state, sent, result)
                assert result is not None
                episode_results.append(result)
            if any(sent is not None and sent.status != "over_budget" for _, sent, _ in episode):
                state.metrics["tool_wait_s"] += waited
            answers.append(episode_results)
        return answers

    def _sender(self, state: EpisodeState, call: ToolCall, request: _Request) -> Any:
        endpoint = self.endpoints[call.name]
        rollout_id = state.data["rollout_id"]
        body = {"rollout_id": rollout_id, "call_id": call.id, "name": call.name, "arguments": call.arguments,
                "item": _item(state.row)}  # fmt: skip
        headers = {**endpoint.get("headers", {}), "X-Rollout-Id": rollout_id, "X-Call-Id": call.id,
                   "Accept": "application/json, text/plain;q=0.9"}  # fmt: skip

        def send(
            **_arguments: Any,
        ) -> None:  # the runner's thread; never raises (the request holds the result)
            started = time.monotonic()
            try:
                reply = post_json(
                    endpoint["server_url"], body, headers=headers, timeout=self.tool_timeout_s,
                    retries=self.max_retries, retry_backoff=RETRY_BACKOFF_S, label=f"tool {call.name!r}",
                    outbound=self.outbound, max_response_bytes=self.max_response_bytes, accept_text=True, retry_timeouts=False,
                )  # fmt: skip
                request.result = _reply_result(reply)
                request.status = "ok" if request.result.error is None else "error"
            except ChatCompletionError as error:
                request.result = ToolResult(json.dumps({"error": str(error)}), error=str(error),
                                            timed_out=error.timed_out)  # fmt: skip
                request.status = "timeout" if error.timed_out else "error"
            request.latency_s = time.monotonic() - started
            request.error = request.result.error

        return send

    def _settle(self, state: EpisodeState, request: _Request, ran: ToolResult | None) -> ToolResult:
        """The call's result as the model reads it, recorded in the episode's metrics and outcome."""
        if request.status != "over_budget":
            if ran is not None and ran.timed_out:  # abandoned by the runner: its message and timing
                request.status, request.error, request.result = "timeout", ran.error, ran
                request.latency_s = self.tool_timeout_s
            elif request.result is None:  # the sender itself failed (a bug): the runner's message
                request.status, request.error, request.result = "error", ran.error if ran else "failed", ran
            metrics = state.metrics
            metrics["tool_endpoint_calls"] += 1
            metrics["tool_latency_s"] += request.latency_s
            metrics["tool_latency_mean_s"] = metrics["tool_latency_s"] / metrics["tool_endpoint_calls"]
        else:
            state.metrics["tool_budget_refused"] += 1
        state.data["requests"].append(request.record())
        assert request.result is not None
        return request.result

    def outcome(self, state: EpisodeState) -> dict[str, Any]:
        return {
            "rollout_id": state.data.get("rollout_id"),
            "tool_requests": list(state.data.get("requests", [])),
        }


def _unbound(**arguments: Any) -> Any:
    raise RuntimeError("an http tool is called through its environment's episode (it needs the rollout id)")


def _reply_result(reply: Any) -> ToolResult:
    """What the model reads of an endpoint's reply (the module docstring's rules)."""
    if isinstance(reply, dict) and "output" in reply:
        output = reply["output"]
        return ToolResult(output if isinstance(output, str) else json.dumps(output, ensure_ascii=False))
    if isinstance(reply, dict) and "error" in reply:
        message = reply["error"] if isinstance(reply["error"], str) else json.dumps(reply["error"])
        return ToolResult(json.dumps({"error": message}, ensure_ascii=False), error=message)
    return ToolResult(reply if isinstance(reply, str) else json.dumps(reply, ensure_ascii=False))


def _tool_config(tool: Any, where: str) -> dict[str, Any]:
    """One tool's settings checked and normalised (description "" and parameters an empty object
    schema by default); ConfigError naming `where.<key>`."""
    if not isinstance(tool, dict):
        raise ConfigError(where, "must be an object {name, description, parameters, server_url, headers}")
    for key in tool:
        if key not in TOOL_KEYS:
            raise ConfigError(f"{where}.{key}", f"unknown key (allowed: {', '.join(TOOL_KEYS)})")
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ConfigError(f"{where}.name", "must be 1 to 64 letters, digits, _ or -")
    description = tool.get("description", "")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
        raise ConfigError(
            f"{where}.description", f"must be a string of at most {MAX_DESCRIPTION_CHARS} characters"
        )
    parameters = tool.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ConfigError(f"{where}.parameters", 'must be a JSON schema object ({"type": "object", ...})')
    url = tool.get("server_url")
    try:  # kept as it is called: a non-ASCII host as its IDNA name, as the mcp kind does
        url = ascii_url(url) if isinstance(url, str) else url
    except OutboundRefused as exc:
        raise ConfigError(f"{where}.server_url", str(exc)) from None
    parsed = urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"{where}.server_url", "must be an http:// or https:// URL")
    headers = tool.get("headers", {})
    check_headers(
        headers,
        f"{where}.headers",
        reserved=RESERVED_HEADERS,
        reserved_message="is set by artweb on every call",
    )
    checked = {"name": name, "description": description, "parameters": parameters, "server_url": url}
    return checked | ({"headers": dict(headers)} if headers else {})
