"""Tools the model can call: their definitions, reading calls out of the model's text, running them.

The model writes calls in the Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(several per turn allowed), which Qwen2.5 and Hermes models are trained on and which our ChatML
models are taught by `tools_system_prompt`. Every failure (an unknown tool, arguments that are not
JSON, an exception, a timeout) becomes a result the model reads, `{"error": "..."}`, never an
exception in the agent loop.

Invariant: a tool runs in a daemon thread and the caller waits at most `timeout_s` for it. Python
cannot kill a thread, so a tool that hangs is abandoned, not stopped: tools must not hold locks or
resources the loop needs, and long-running work belongs in a subprocess the tool itself controls.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.rollouts.strict_json import loads_lenient

# A call runs to its closing tag, or to the end of the text: a stop string such as
# "</tool_call>" cuts the text before the tag, and the call before it is still meant.
TOOL_CALL_PATTERN = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Tool:
    """A Python function the model may call, described by a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object, as in OpenAI's tools
    function: Callable[..., Any]  # called with the arguments as keyword arguments

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style definition, as chat templates and the system prompt show it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass
class ToolCall:
    """One call as the model wrote it. `error` says why it cannot be run (it is then not run)."""

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str  # the arguments as a JSON string, OpenAI-style; the raw text if not JSON
    error: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The entry of an assistant message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


@dataclass
class ToolResult:
    """What a call returned, as the text the model reads."""

    content: str
    error: str | None = None  # set when the call failed, timed out included
    timed_out: bool = False


def tools_system_prompt(tools: list[Tool]) -> str:
    """How a model whose chat template knows no tools learns about them: appended to the system
    prompt. Hermes' wording and format, short, since small models read it on every turn."""
    return tools_prompt([tool.schema() for tool in tools])


def tools_prompt(definitions: list[dict[str, Any]]) -> str:
    """`tools_system_prompt` for OpenAI function definitions (a task row's `tools`)."""
    schemas = "\n".join(json.dumps(definition["function"], ensure_ascii=False) for definition in definitions)
    return (
        "You can call tools. Their JSON schemas:\n"
        f"<tools>\n{schemas}\n</tools>\n"
        "To call a tool, write:\n"
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
        "Results come back in tool messages. When you know the answer, reply without a tool call."
    )


def written_calls(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's content with its OpenAI `tool_calls` written after it as the model
    writes calls (the Hermes blocks `parse_tool_calls` reads back): how a template that knows no
    tools shows them, in SFT targets, rollout prompts and served conversations alike."""
    written = ""
    for call in tool_calls:
        try:
            arguments = loads_lenient(call["function"]["arguments"])
        except json.JSONDecodeError:
            arguments = call["function"]["arguments"]
        written += (
            "<tool_call>"
            + json.dumps({"name": call["function"]["name"], "arguments": arguments})
            + "</tool_call>"
        )
    return f"{content}\n{written}" if content else written


def parse_tool_calls(text: str, id_prefix: str = "call_") -> list[ToolCall]:
    """The calls in a model turn, in order; ids are `id_prefix` + index. A call that is not a JSON
    object with a string `name` and object `arguments` comes back with `error` set."""
    calls = []
    for index, match in enumerate(TOOL_CALL_PATTERN.finditer(text)):
        calls.append(_parse_one(match.group(1).strip(), f"{id_prefix}{index}"))
    return calls


def _parse_one(body: str, call_id: str) -> ToolCall:
    def invalid(message: str, name: str = "") -> ToolCall:
        return ToolCall(id=call_id, name=name, arguments={}, arguments_json=body, error=message)

    try:
        data = loads_lenient(body)
    except json.JSONDecodeError as exc:
        return invalid(f"the tool call is not valid JSON: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return invalid('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = data["name"]
    # "parameters" is Llama 3's key for the same thing.
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI does
        try:
            arguments = loads_lenient(arguments)
        except json.JSONDecodeError as exc:
            return invalid(f"the arguments of {name!r} are not valid JSON: {exc}", name)
    if not isinstance(arguments, dict):
        return invalid(f"the arguments of {name!r} must be a JSON object", name)
    return ToolCall(
        id=call_id, name=name, arguments=arguments, arguments_json=json.dumps(arguments, ensure_ascii=False)
    )


def run_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
    """Call one tool, giving up after `timeout_s` seconds (see the module invariant)."""
    return _Running(tool, arguments).wait(time.monotonic() + timeout_s, timeout_s)


def run_tool_calls(calls: list[ToolCall], tools: list[Tool], timeout_s: float) -> list[ToolResult]:
    """One result per call, in order. The runnable calls all start at once, so a turn of many
    trajectories waits for its slowest tool, at most `timeout_s`, not for the sum of them."""
    return run_tool_call_batches([(calls, tools)], timeout_s)[0]


def run_tool_call_batches(
    batches: list[tuple[list[ToolCall], list[Tool]]], timeout_s: float
) -> list[list[ToolResult]]:
    """`run_tool_calls` for many episodes at once, each with its own tools (a `lookup` tool bound
    to its task row): every runnable call starts at once and all share one deadline."""
    results: list[list[ToolResult | None]] = []
    running: list[tuple[int, int, _Running]] = []
    for batch_index, (calls, tools) in enumerate(batches):
        by_name = {tool.name: tool for tool in tools}
        batch_results: list[ToolResult | None] = []
        for call in calls:
            if call.error is not None:
                batch_results.append(_error_result(call.error))
            elif call.name not in by_name:
                known = ", ".join(sorted(by_name)) or "none"
                batch_results.append(_error_result(f"unknown tool {call.name!r} (tools: {known})"))
            else:
                running.append(
                    (batch_index, len(batch_results), _Running(by_name[call.name], call.arguments))
                )
                batch_results.append(None)
        results.append(batch_results)
    deadline = time.monotonic() + timeout_s
    for batch_index, index, job in running:
        results[batch_index][index] = job.wait(deadline, timeout_s)
    return [[result for result in batch if result is not None] for batch in results]


class _Running:
    """A tool call in its own daemon thread (a daemon, so a hung tool cannot keep the process alive)."""

    def __init__(self, tool: Tool, arguments: dict[str, Any]) -> None:
        self.tool = tool
        self.value: Any = None
        self.exception: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(arguments,), daemon=True)
        self.thread.start()

    def _run(self, arguments: dict[str, Any]) -> None:
        try:
            self.value = self.tool.function(**arguments)
        except BaseException as exc:  # the model reads about any failure, SystemExit included
            self.exception = exc

    def wait(self, deadline: float, timeout_s: float) -> ToolResult:
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            message = f"tool {self.tool.name!r} did not finish within {timeout_s:g} s"
            return ToolResult(content=json.dumps({"error": message}), error=message, timed_out=True)
        if self.exception is not None:
            return _error_result(f"{type(self.exception).__name__}: {self.exception}")
        return ToolResult(content=_as_text(self.value))


def _error_result(message: str) -> ToolResult:
    return ToolResult(content=json.dumps({"error": message}, ensure_ascii=False), error=message)


def _as_text(value: Any) -> str:
    """What the model reads: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):  # e.g. a circular structure
        return str(value)
