"""Fine-tuning files as OpenAI writes them, as artweb task rows and back (``/v1/files``; the jobs that
train on them are ``projects.services.fine_tuning``).

Rows: a file is JSONL in any of OpenAI's three formats and is stored as task rows, line by line:
- reinforcement: ``{"messages": [...], <any other field>}``: the prompt, and the other fields as the
  grader's ``item``;
- supervised (chat): ``{"messages": [..., {"role": "assistant", "content": ...}]}``: the last
  assistant message is the row's ``completion`` (what an SFT run trains on), the rest the prompt;
- preference (DPO): ``{"input": {"messages": [...]}, "preferred_output": [assistant message],
  "non_preferred_output": [assistant message]}``: ``chosen`` and ``rejected``.
A supervised or preference row's target is also its ``item.reference``, so a job's default grader
(text similarity to the reference) scores held-out answers. Which method a file can train is
checked when a job names it, as OpenAI does.

Tools: a line's ``tools`` (OpenAI's function definitions) and ``parallel_tool_calls`` (in a
preference line: ``input``'s) become the row's own fields, never the grader's item; a rollout
offers the tools to the model and keeps one call per turn where ``parallel_tool_calls`` is false
(``training.rollouts.agent``). Messages keep an assistant's ``tool_calls`` (arguments a JSON
string, each naming one of the row's tools), a tool message's ``tool_call_id`` (answering an
earlier call), and ``"weight": 0`` on an assistant message (context: SFT does not train on it;
``training.recipes.supervised``). A supervised line whose last reply calls tools or has weight 0
keeps its targets in ``messages`` and has no ``completion``; a preference output with tool calls is
stored as the assistant message, not its text. A reinforcement prompt cannot hold earlier tool
calls: the grader's ``output_tools`` lists every call of the transcript, and would count them as
the model's. A chat line in the deprecated ``functions``/``function_call`` format is read as
its ``tools`` equivalent (``_without_functions``) and written back in that format.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.utils.text import slugify

from projects.errors import ValidationFailed
from projects.models import Project, TaskSet
from projects.services import task_sets
from training.rollouts import strict_json

__all__ = ["file_create", "openai_line", "task_row"]


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise _RowError(f"{where}.content", "must be a string or a list of text parts (images are not supported)")


class _RowError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


ROLES = {"system", "developer", "user", "assistant", "tool"}


def _tools(line: dict[str, Any], where: str) -> dict[str, Any]:
    """A row's ``tools`` and ``parallel_tool_calls`` as stored (absent ones stay absent)."""
    found: dict[str, Any] = {}
    if "tools" in line:
        tools = line["tools"]
        if not isinstance(tools, list) or not tools:
            raise _RowError(
                f"{where}tools", "must be a non-empty list of function tools (leave it out for none)"
            )
        names = set()
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise _RowError(
                    f"{where}tools[{i}]", 'must be {"type": "function", "function": {"name", ...}}'
                )
            name = function.get("name")
            if not isinstance(name, str) or not name or name in names:
                raise _RowError(
                    f"{where}tools[{i}].function.name", "must be a non-empty string, unique in the row"
                )
            if not isinstance(function.get("description", ""), str):
                raise _RowError(f"{where}tools[{i}].function.description", "must be a string")
            if not isinstance(function.get("parameters", {}), dict):
                raise _RowError(f"{where}tools[{i}].function.parameters", "must be a JSON schema object")
            names.add(name)
        found["tools"] = tools
    if "parallel_tool_calls" in line:
        if not isinstance(line["parallel_tool_calls"], bool):
            raise _RowError(f"{where}parallel_tool_calls", "must be true or false")
        found["parallel_tool_calls"] = line["parallel_tool_calls"]
    return found


def _tool_calls(value: Any, where: str, tools: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as stored: OpenAI's shape, arguments a JSON string."""
    offered = {tool["function"]["name"] for tool in tools.get("tools", [])}
    if not offered:
        raise _RowError(where, "the row offers no tools (give them in the row's tools)")
    if not isinstance(value, list) or not value:
        raise _RowError(where, "must be a non-empty list of calls")
    if len(value) > 1 and tools.get("parallel_tool_calls") is False:
        raise _RowError(where, "parallel_tool_calls is false: at most one call per assistant message")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or call.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise _RowError(
                f"{where}[{j}]", 'must be {"id", "type": "function", "function": {"name", "arguments"}}'
            )
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise _RowError(f"{where}[{j}].id", "must be a non-empty string")
        if function.get("name") not in offered:
            raise _RowError(f"{where}[{j}].function.name", "must name one of the row's tools")
        arguments = function.get("arguments")
        try:
            parsed = strict_json.loads(arguments) if isinstance(arguments, str) else None
        except strict_json.JSONError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _RowError(f"{where}[{j}].function.arguments", "must be a JSON object written as a string")
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _messages(value: Any, where: str, tools: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Messages as stored: ``{role, content}`` (developer as system); an assistant message keeps its
    ``tool_calls`` and a weight of 0 (``"weight": 0``: context, not a target); a tool message its
    ``tool_call_id``, which must answer a call of an earlier assistant message."""
    if not isinstance(value, list) or not value:
        raise _RowError(where, "must be a non-empty list of messages")
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, message in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise _RowError(at, "must be an object")
        if message.get("function_call") or message.get("role") == "function":
            raise _RowError(at, "function_call is taken in a chat row only: give tool_calls")
        if message.get("weight", 1) not in (0, 1) or isinstance(message.get("weight"), bool):
            raise _RowError(f"{at}.weight", "must be 0 or 1")
        if message.get("role") not in ROLES:
            raise _RowError(f"{at}.role", "must be system, developer, user, assistant or tool")
        role = "system" if message["role"] == "developer" else message["role"]
        if role != "assistant" and "tool_calls" in message:
            raise _RowError(f"{at}.tool_calls", "only an assistant message makes tool calls")
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _tool_calls(message["tool_calls"], f"{at}.tool_calls", tools or {})
            content = "" if message.get("content") is None else _text(message["content"], at)
            stored: dict[str, Any] = {"role": role, "content": content, "tool_calls": calls}
            call_ids.update(call["id"] for call in calls)
        else:
            stored = {"role": role, "content": _text(message.get("content"), at)}
        if role == "tool":
            if message.get("tool_call_id") not in call_ids:
                raise _RowError(
                    f"{at}.tool_call_id", "must be the id of a tool call of an earlier assistant message"
                )
            stored["tool_call_id"] = message["tool_call_id"]
        if role == "assistant" and message.get("weight") == 0:
            stored["weight"] = 0
        messages.append(stored)
    return messages


def _one_reply(value: Any, where: str, tools: dict[str, Any] | None = None) -> str | dict[str, Any]:
    """A preference row's output: its text, or (with tool calls) the assistant message."""
    if not isinstance(value, list) or len(value) != 1:
        raise _RowError(where, "must be a list of exactly one assistant message")
    (message,) = _messages(value, where, tools)
    if message["role"] != "assistant":
        raise _RowError(f"{where}[0].role", "must be assistant")
    if message.get("weight") == 0:
        raise _RowError(
            f"{where}[0].weight", "a preferred or non-preferred output is the target: weight 0 is not"
        )
    return message if "tool_calls" in message else message["content"]


def _reply_text(reply: str | dict[str, Any]) -> str:
    return reply if isinstance(reply, str) else str(reply["content"])


def _without_functions(line: dict[str, Any]) -> dict[str, Any]:
    """A line in OpenAI's deprecated function-calling format in today's: ``functions`` as
    ``tools``, an assistant's ``function_call`` as its one tool call (id ``call_<message index>``),
    a ``function`` message as the tool message answering the call before it. (Written back, such a
    row is in today's format.)"""
    messages = line.get("messages")
    legacy = isinstance(messages, list) and any(
        isinstance(m, dict) and ("function_call" in m or m.get("role") == "function") for m in messages
    )
    if "functions" not in line and not legacy:
        return line
    if "tools" in line:
        raise _RowError("functions", "give tools or the deprecated functions, not both")
    line = dict(line)
    if "functions" in line:
        functions = line.pop("functions")
        if not isinstance(functions, list) or not functions:
            raise _RowError("functions", "must be a non-empty list of function definitions")
        for i, function in enumerate(functions):
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise _RowError(
                    f"functions[{i}]", "must be a function definition {name, description, parameters}"
                )
        line["tools"] = [{"type": "function", "function": function} for function in functions]
    if legacy and isinstance(messages, list):
        converted: list[Any] = []
        call_id = None
        for i, message in enumerate(messages):
            if isinstance(message, dict) and "function_call" in message:
                call = message["function_call"]
                if message.get("role") != "assistant" or not isinstance(call, dict):
                    raise _RowError(
                        f"messages[{i}].function_call", "must be an assistant's {name, arguments}"
                    )
                call_id = f"call_{i}"
                function = {"name": call.get("name"), "arguments": call.get("arguments")}
                rest = {key: value for key, value in message.items() if key != "function_call"}
                message = {**rest, "tool_calls": [{"id": call_id, "type": "function", "function": function}]}
            elif isinstance(message, dict) and message.get("role") == "function":
                if call_id is None:
                    raise _RowError(
                        f"messages[{i}].role", "a function message answers an earlier function_call"
                    )
                message = {"role": "tool", "tool_call_id": call_id, "content": message.get("content")}
            converted.append(message)
        line["messages"] = converted
    return line


def task_row(line: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI fine-tuning file as an artweb task row (the module docstring)."""
    if "input" in line or "preferred_output" in line or "non_preferred_output" in line:
        unknown = set(line) - {"input", "preferred_output", "non_preferred_output"}
        if unknown:
            raise _RowError(sorted(unknown)[0], "unknown field in a preference row")
        source = line.get("input")
        if not isinstance(source, dict):
            raise _RowError("input", "must be an object with messages")
        unknown = set(source) - {"messages", "tools", "parallel_tool_calls"}
        if unknown:
            raise _RowError(
                f"input.{sorted(unknown)[0]}",
                "unknown field (input takes messages, tools, parallel_tool_calls)",
            )
        tools = _tools(source, "input.")
        chosen = _one_reply(line.get("preferred_output"), "preferred_output", tools)
        rejected = _one_reply(line.get("non_preferred_output"), "non_preferred_output", tools)
        messages = _messages(source.get("messages"), "input.messages", tools)
        return {"messages": messages, "chosen": chosen, "rejected": rejected, **tools,
                "item": {"reference": _reply_text(chosen)}}  # fmt: skip
    if "messages" not in line:
        raise _RowError(
            "messages", "a row needs messages (or input with preferred_output and non_preferred_output)"
        )
    line = _without_functions(line)
    tools = _tools(line, "")
    messages = _messages(line["messages"], "messages", tools)
    item = {
        key: value for key, value in line.items() if key not in ("messages", "tools", "parallel_tool_calls")
    }
    if messages[-1]["role"] != "assistant":  # reinforcement: the prompt, and the grader's item
        for i, message in enumerate(messages):
            if message["role"] == "tool" or "tool_calls" in message:
                # The grader's output_tools lists every call of the transcript: earlier ones would
                # read as the model's own.
                raise _RowError(
                    f"messages[{i}]", "a reinforcement row's prompt cannot hold earlier tool calls"
                )
        return {"messages": messages, **tools, "item": item}
    targets = [m for m in messages if m["role"] == "assistant" and m.get("weight") != 0]
    if not targets:
        raise _RowError("messages", "every assistant message has weight 0: a supervised row needs a target")
    if not any(message["role"] == "user" for message in messages[:-1]):
        raise _RowError("messages", "a supervised row needs a user message before the assistant's reply")
    reference = targets[-1]["content"]
    last = messages[-1]
    if last.get("weight") == 0 or "tool_calls" in last:  # the targets are marked in the messages
        return {"messages": messages, **tools, "item": {**item, "reference": reference}}
    return {
        "messages": messages[:-1],
        "completion": last["content"],
        **tools,
        "item": {**item, "reference": reference},
    }


def openai_line(row: dict[str, Any]) -> dict[str, Any]:
    """A task row written back as a line of OpenAI's format (a file's ``content``)."""
    item = dict(row.get("item") or {})
    tools = {key: row[key] for key in ("tools", "parallel_tool_calls") if key in row}
    if "chosen" in row:
        if item.get("reference") == _reply_text(row["chosen"]):
            item.pop("reference")
        reply = lambda value: value if isinstance(value, dict) else {"role": "assistant", "content": value}  # noqa: E731
        return {
            "input": {"messages": row["messages"], **tools},
            "preferred_output": [reply(row["chosen"])],
            "non_preferred_output": [reply(row["rejected"])],
            **({"item": item} if item else {}),
        }
    messages = row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}]
    if "completion" in row:
        messages = [*messages, {"role": "assistant", "content": row["completion"]}]
    targets = [m for m in messages if m.get("role") == "assistant" and m.get("weight") != 0]
    if (
        targets
        and messages[-1].get("role") == "assistant"
        and item.get("reference") == targets[-1].get("content")
    ):
        item.pop("reference")
    return {"messages": messages, **tools, **item}


def file_create(*, project: Project, filename: str, jsonl: str, purpose: str) -> TaskSet:
    """An uploaded fine-tuning file as a task set (every row a training row; a job's validation
    file supplies the held-out rows). Bad lines: one 400 listing them, as task-set uploads."""
    if purpose != "fine-tune":
        raise ValidationFailed("only purpose 'fine-tune' is supported", field="purpose")
    rows: list[Any] = []
    problems: list[tuple[str, str]] = []
    for number, raw in enumerate(strict_json.jsonl_lines(jsonl), start=1):
        if not raw.strip():
            continue
        try:
            line = strict_json.loads(raw, allow_nul=False)
        except strict_json.JSONError as exc:
            problems.append((f"line {number}", f"invalid JSON: {exc.message} (column {exc.column})"))
            continue
        if not isinstance(line, dict):
            problems.append((f"line {number}", "must be a JSON object"))
            continue
        try:
            rows.append(task_row(line))
        except _RowError as exc:
            problems.append((f"line {number}: {exc.field}", exc.message))
    if problems:
        raise task_sets.lines_invalid(problems, field="file")
    stem = slugify(filename.rsplit(".", 1)[0])[:40].strip("-_") or "file"
    task_set = task_sets.task_set_create(
        project=project,
        name=f"{stem}-{secrets.token_hex(3)}",
        rows=[{**row, "split": "train"} for row in rows],
    )
    task_set.source = {
        "openai_file": {"filename": filename[:255], "bytes": len(jsonl.encode()), "purpose": purpose}
    }
    task_set.save(update_fields=["source"])
    return task_set
