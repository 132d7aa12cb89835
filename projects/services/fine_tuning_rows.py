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


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _RowError(where, "must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _RowError(f"{where}[{i}]", "must be an object")
        if message.get("tool_calls") or message.get("function_call"):
            raise _RowError(f"{where}[{i}]", "tool calls in fine-tuning files are not supported")
        if message.get("weight", 1) not in (0, 1):
            raise _RowError(f"{where}[{i}].weight", "must be 0 or 1")
        if message.get("role") not in {"system", "developer", "user", "assistant"}:
            raise _RowError(f"{where}[{i}].role", "must be system, developer, user or assistant")
        role = "system" if message["role"] == "developer" else message["role"]
        messages.append({"role": role, "content": _text(message.get("content"), f"{where}[{i}]")})
    return messages


def _one_reply(value: Any, where: str) -> str:
    if not isinstance(value, list) or len(value) != 1:
        raise _RowError(where, "must be a list of exactly one assistant message")
    (message,) = _messages(value, where)
    if message["role"] != "assistant":
        raise _RowError(f"{where}[0].role", "must be assistant")
    return message["content"]


def task_row(line: dict[str, Any]) -> dict[str, Any]:
    """One line of an OpenAI fine-tuning file as an artweb task row (the module docstring)."""
    if "input" in line or "preferred_output" in line or "non_preferred_output" in line:
        unknown = set(line) - {"input", "preferred_output", "non_preferred_output"}
        if unknown:
            raise _RowError(sorted(unknown)[0], "unknown field in a preference row")
        source = line.get("input")
        if not isinstance(source, dict):
            raise _RowError("input", "must be an object with messages")
        if set(source) - {"messages"}:
            raise _RowError(f"input.{sorted(set(source) - {'messages'})[0]}", "not supported (tools are not)")
        chosen = _one_reply(line.get("preferred_output"), "preferred_output")
        rejected = _one_reply(line.get("non_preferred_output"), "non_preferred_output")
        messages = _messages(source.get("messages"), "input.messages")
        return {"messages": messages, "chosen": chosen, "rejected": rejected, "item": {"reference": chosen}}
    if "messages" not in line:
        raise _RowError(
            "messages", "a row needs messages (or input with preferred_output and non_preferred_output)"
        )
    for field in ("tools", "functions", "parallel_tool_calls"):
        if field in line:
            raise _RowError(field, "tools in fine-tuning files are not supported")
    messages = _messages(line["messages"], "messages")
    item = {key: value for key, value in line.items() if key != "messages"}
    if messages[-1]["role"] != "assistant":  # reinforcement: the prompt, and the grader's item
        return {"messages": messages, "item": item}
    if line["messages"][-1].get("weight", 1) == 0:
        raise _RowError(
            f"messages[{len(messages) - 1}].weight",
            "the last assistant message is the target: weight 0 is not supported",
        )
    prompt = messages[:-1]
    if not any(message["role"] == "user" for message in prompt):
        raise _RowError("messages", "a supervised row needs a user message before the assistant's reply")
    completion = messages[-1]["content"]
    return {"messages": prompt, "completion": completion, "item": {**item, "reference": completion}}


def openai_line(row: dict[str, Any]) -> dict[str, Any]:
    """A task row written back as a line of OpenAI's format (a file's ``content``)."""
    item = dict(row.get("item") or {})
    if "chosen" in row:
        if item.get("reference") == row["chosen"]:
            item.pop("reference")
        return {
            "input": {"messages": row["messages"]},
            "preferred_output": [{"role": "assistant", "content": row["chosen"]}],
            "non_preferred_output": [{"role": "assistant", "content": row["rejected"]}],
            **({"item": item} if item else {}),
        }
    messages = row.get("messages") or [{"role": "user", "content": row.get("prompt", "")}]
    if "completion" in row:
        if item.get("reference") == row["completion"]:
            item.pop("reference")
        messages = [*messages, {"role": "assistant", "content": row["completion"]}]
    return {"messages": messages, **item}


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
