"""A policy behind any OpenAI-compatible endpoint: our gateway (another team model, a base model)
or an external endpoint the team configured (``JudgeEndpoint``, key decrypted by the caller).

The episode loop drives the environment registry's message-level protocol (``training.environments``):
send the conversation (with the environment's tools as OpenAI ``tools``), read the reply, hand its
tool calls (OpenAI ``tool_calls``, or Hermes ``<tool_call>`` blocks in the text for models served
without a tool parser, like ours) to ``environment.respond``, append its reply, until it is done or
``max_turns`` model turns. Every failure of a sample (HTTP error, timeout, malformed reply) is
recorded on that sample as ``metrics["policy_error"]``; nothing here raises for one bad sample.

The HTTP call (the outbound-URL policy, retries, a 4 MiB cap, refused redirects so the API key
goes only to ``base_url``, no key and no upstream body in error messages) is ``training.wire.openai_http.ChatCompletionsEndpoint.post``, shared with the
judge.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from training.environments import Environment
from training.rollouts.strict_json import loads_lenient
from training.rollouts.tools import ToolCall, parse_tool_calls
from training.rollouts.trajectory import Trajectory
from training.wire.openai_http import ChatCompletionError, ChatCompletionsEndpoint, first_choice


class EndpointError(RuntimeError):
    """The endpoint failed or answered something that is not a chat completion."""


@dataclass(frozen=True)
class ChatReply:
    content: str
    tool_calls: list[dict[str, Any]]  # OpenAI shape: {id, type, function: {name, arguments (JSON text)}}
    finish_reason: str
    usage: dict[str, int]


@dataclass(frozen=True)
class ChatEndpoint(ChatCompletionsEndpoint):
    """An OpenAI-compatible endpoint a policy's turns are sent to (base_url, api_key, timeout,
    retries, retry_backoff: ``training.wire.openai_http.ChatCompletionsEndpoint``)."""

    def chat(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> ChatReply:
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = tools
        if temperature is not None:
            body["temperature"] = temperature
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if seed is not None:
            body["seed"] = seed
        try:
            payload = self.post(body)
        except ChatCompletionError as error:
            raise EndpointError(str(error)) from None
        return parse_reply(payload)


def parse_reply(payload: Any) -> ChatReply:
    """A decoded chat completion as a ChatReply; EndpointError if it is not one."""
    try:
        choice, message, content = first_choice(payload)
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError("tool_calls is not a list")
    except ValueError as exc:  # what it answered is not shown: an upstream body is never echoed
        raise EndpointError(f"not a chat completion ({exc})") from None
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    return ChatReply(
        content=content,
        tool_calls=calls,
        finish_reason=str(choice.get("finish_reason") or "stop"),
        usage={k: int(v) for k, v in usage.items() if isinstance(v, int)},
    )


def _to_tool_call(call: Any, fallback_id: str) -> ToolCall:
    """An OpenAI ``tool_calls`` entry as our ToolCall (arguments parsed; an error if they are not
    a JSON object, which the model then reads as the tool's result)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return ToolCall(fallback_id, "", {}, json.dumps(call), error="malformed tool call")
    function = call["function"]
    name = str(function.get("name") or "")
    raw = function.get("arguments")
    call_id = str(call.get("id") or fallback_id)
    if isinstance(raw, dict):
        return ToolCall(call_id, name, raw, json.dumps(raw, ensure_ascii=False))
    text = raw if isinstance(raw, str) else ""
    try:
        arguments = loads_lenient(text or "{}")
    except json.JSONDecodeError as exc:
        return ToolCall(call_id, name, {}, text, error=f"the arguments of {name!r} are not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return ToolCall(call_id, name, {}, text, error=f"the arguments of {name!r} must be a JSON object")
    return ToolCall(call_id, name, arguments, text or "{}")


@dataclass
class RemotePolicy:
    """A model behind a ChatEndpoint, driving the same environment (tools, max turns) as training."""

    endpoint: ChatEndpoint
    model: str
    temperature: float = 0.0
    max_tokens: int = 256
    seed: int | None = 0
    max_concurrency: int = 4
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or self.model

    def rollout(
        self, rows: list[dict[str, Any]], env: Environment, samples_per_row: int
    ) -> list[list[Trajectory]]:
        jobs = [(row["data"], sample) for row in rows for sample in range(samples_per_row)]
        with ThreadPoolExecutor(max_workers=max(1, self.max_concurrency)) as pool:
            episodes = list(pool.map(lambda job: self.episode(job[0], env, job[1]), jobs))
        return [episodes[i * samples_per_row : (i + 1) * samples_per_row] for i in range(len(rows))]

    def episode(self, row: dict[str, Any], env: Environment, sample_index: int = 0) -> Trajectory:
        """One conversation through the environment protocol (``start`` → messages; after each
        model turn ``respond`` → tool or user messages and done; ``outcome``), the same protocol
        training drives token by token. Never raises: failures become ``metrics["policy_error"]``."""
        metrics: dict[str, Any] = {"turns": 0, "tool_calls": 0}
        messages: list[dict[str, Any]] = []
        outcome: dict[str, Any] = {}
        finish = "error"
        seed = None if self.seed is None else self.seed + sample_index
        try:
            state = env.start(row, seed=seed)
            messages = list(state.messages)
            tools = list(state.tools)
            # A task row's own tools are offered too (training.rollouts.agent.rollout_groups).
            own = {tool.name for tool in tools}
            offered = [d for d in row.get("tools") or [] if d.get("function", {}).get("name") not in own]
            schemas = [tool.schema() for tool in tools] + offered or None
            for turn in range(1, env.max_turns + 1):
                reply = self.endpoint.chat(
                    model=self.model,
                    messages=messages,
                    tools=schemas,
                    temperature=self.temperature,
                    max_tokens=self.max_tokens,
                    seed=seed,
                )
                calls: list[ToolCall] = []
                if schemas:  # OpenAI tool_calls, or Hermes blocks in the text (our own models)
                    calls = [_to_tool_call(c, f"call_{turn}_{i}") for i, c in enumerate(reply.tool_calls)]
                    calls = calls or parse_tool_calls(reply.content, id_prefix=f"call_{turn}_")
                    if row.get("parallel_tool_calls") is False:
                        calls = calls[:1]  # as rollout_groups: the later calls are not run
                message: dict[str, Any] = {"role": "assistant", "content": reply.content}
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                messages.append(message)
                metrics["turns"] += 1
                metrics["tool_calls"] += len(calls)
                answer = env.respond(state, reply.content, calls)
                messages += answer.messages
                finish = answer.finish_reason or reply.finish_reason
                if answer.done:
                    break
            metrics.update(state.metrics)
            outcome = dict(env.outcome(state) or {})
        except Exception as exc:  # one failed sample is data; the evaluation goes on
            metrics["policy_error"] = (
                str(exc) if isinstance(exc, EndpointError) else f"{type(exc).__name__}: {exc}"
            )
            finish = "error"
        return Trajectory(
            messages=messages,
            prompt_token_ids=[],
            completion_token_ids=[],
            logprobs=[],
            finish_reason=finish,
            metrics=metrics,
            outcome=outcome,
        )
