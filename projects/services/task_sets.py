"""Task sets: rows ``{messages|prompt, item[, completion | chosen, rejected]}`` uploaded as JSONL (or given as a list, as scenario
generation does), checked by the upload rules below, split into train and validation."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction

from projects.errors import ValidationFailed
from projects.models import Project, TaskRow, TaskSet
from projects.services._common import check_slug, check_text_length, create_unique, delete_unless_used
from training.rollouts import strict_json

MAX_ERRORS_REPORTED = 20
# A row's fields: the prompt (messages or prompt), the grader's item, the targets SFT
# (completion) and DPO (chosen, rejected) runs train on, and the tools the row offers the model
# (OpenAI's function definitions; parallel_tool_calls false: one call per turn).
ROW_FIELDS = {"messages", "prompt", "item", "split", "id", "completion", "chosen", "rejected", "tools",
              "parallel_tool_calls"}  # fmt: skip


@dataclass
class ParsedRow:
    data: dict[str, Any]
    split: str | None


def _row_problems(row: Any) -> list[tuple[str, str]]:
    if not isinstance(row, dict):
        return [("", "must be a JSON object")]
    problems: list[tuple[str, str]] = []
    unknown = set(row) - ROW_FIELDS
    for key in sorted(unknown):
        problems.append((key, f"unknown field (allowed: {', '.join(sorted(ROW_FIELDS))})"))
    if "completion" in row and not isinstance(row["completion"], str):
        problems.append(("completion", "must be a string (the assistant's reply an SFT run trains on)"))
    if ("chosen" in row) != ("rejected" in row):
        problems.append(
            ("chosen" if "rejected" in row else "rejected", "a preference row needs both chosen and rejected")
        )
    for key in ("chosen", "rejected"):
        value = row.get(key, "")
        if not (isinstance(value, str) or (isinstance(value, dict) and value.get("role", "assistant") == "assistant"
                                           and isinstance(value.get("content"), str))):  # fmt: skip
            problems.append((key, "must be a string or an assistant message {role: assistant, content}"))
    if "tools" in row and (
        not isinstance(row["tools"], list)
        or not all(
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict)
            and isinstance(tool["function"].get("name"), str)
            for tool in row["tools"]
        )
    ):
        problems.append(
            (
                "tools",
                'must be a list of OpenAI function definitions {"type": "function", "function": {"name", ...}}',
            )
        )
    if "parallel_tool_calls" in row and not isinstance(row["parallel_tool_calls"], bool):
        problems.append(("parallel_tool_calls", "must be true or false"))
    has_messages, has_prompt = "messages" in row, "prompt" in row
    if has_messages == has_prompt:
        problems.append(("messages", "give exactly one of 'messages' or 'prompt'"))
    if has_prompt and (not isinstance(row["prompt"], str) or not row["prompt"].strip()):
        problems.append(("prompt", "must be a non-empty string"))
    if has_messages:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            problems.append(("messages", "must be a non-empty list of {role, content}"))
        else:
            for i, message in enumerate(messages):
                if not isinstance(message, dict):
                    problems.append((f"messages[{i}]", "must be an object"))
                    continue
                if message.get("role") not in {"system", "user", "assistant", "tool"}:
                    problems.append((f"messages[{i}].role", "must be system, user, assistant or tool"))
                if not isinstance(message.get("content"), str):
                    problems.append((f"messages[{i}].content", "must be a string"))
    if "item" in row and not isinstance(row["item"], dict):
        problems.append(("item", "must be an object"))
    if "split" in row and row["split"] not in {"train", "validation"}:
        problems.append(("split", "must be 'train' or 'validation'"))
    return problems


def lines_invalid(problems: list[tuple[str, str]], *, field: str) -> ValidationFailed:
    """One 400 on ``field`` listing the first MAX_ERRORS_REPORTED bad lines (and how many more)."""
    shown = problems[:MAX_ERRORS_REPORTED]
    more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
    summary = "; ".join(f"{where}: {message}" for where, message in shown) + more
    return ValidationFailed(summary, field=field, problems=shown)


def parse_rows(*, jsonl: str | None = None, rows: list[Any] | None = None) -> list[ParsedRow]:
    """Parse JSONL text or a list of row objects; raise ValidationFailed listing bad lines."""
    if (jsonl is None) == (rows is None):
        raise ValidationFailed("give either a JSONL file or a list of rows", field="file")
    numbered: list[tuple[int, Any]] = []
    problems: list[tuple[str, str]] = []
    if jsonl is not None:
        for line_number, line in enumerate(strict_json.jsonl_lines(jsonl), start=1):
            if not line.strip():
                continue
            try:  # the strict reader: depth, NaN, number range, lone surrogates, NUL
                numbered.append((line_number, strict_json.loads(line, allow_nul=False)))
            except strict_json.JSONError as exc:
                problems.append((f"line {line_number}", f"invalid JSON: {exc.message} (column {exc.column})"))
    else:
        assert rows is not None
        for line_number, row in enumerate(rows, start=1):
            try:  # rows that did not come through the strict reader (generated, given in code)
                strict_json.check(row, allow_nul=False)
                numbered.append((line_number, row))
            except strict_json.JSONError as exc:
                problems.append((f"line {line_number}" + (f": {exc.path}" if exc.path else ""), exc.message))
    for line_number, row in numbered:
        for field, message in _row_problems(row):
            where = f"line {line_number}" + (f": {field}" if field else "")
            problems.append((where, message))
    if problems:
        raise lines_invalid(problems, field="file" if jsonl is not None else "rows")
    if not numbered:
        raise ValidationFailed("the task set has no rows", field="file" if jsonl is not None else "rows")
    parsed = []
    for _, row in numbered:
        split = row.pop("split", None)
        parsed.append(ParsedRow(data=row, split=split))
    return parsed


def assign_splits(rows: list[ParsedRow], *, validation_fraction: float, seed: int = 0) -> list[str]:
    """Rows with an explicit split keep it; the rest are split deterministically by ``seed``."""
    undecided = [i for i, row in enumerate(rows) if row.split is None]
    order = list(undecided)
    random.Random(seed).shuffle(order)
    n_validation = int(round(len(undecided) * validation_fraction))
    validation = set(order[:n_validation])
    return [
        row.split if row.split is not None else ("validation" if i in validation else "train")
        for i, row in enumerate(rows)
    ]


def task_set_rows_check(*, jsonl: str, validation_fraction: float = 0.0, seed: int = 0) -> None:
    """The checks ``task_set_create`` makes of an upload's rows and split, without saving it: a
    form calls it with its other checks, so a bad file does not hide the form's other problems."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValidationFailed("must be in [0, 1)", field="validation_fraction")
    parsed = parse_rows(jsonl=jsonl)
    if "train" not in assign_splits(parsed, validation_fraction=validation_fraction, seed=seed):
        raise ValidationFailed("the task set needs at least one training row", field="validation_fraction")


def task_set_create(
    *,
    project: Project,
    name: str,
    jsonl: str | None = None,
    rows: list[Any] | None = None,
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> TaskSet:
    check_slug(name, "name")
    # The same bound as an uploaded file's (in characters, which are never more than its bytes).
    check_text_length(jsonl, field="jsonl", max_chars=settings.MAX_TASKSET_BYTES)
    if not 0.0 <= validation_fraction < 1.0:
        raise ValidationFailed("must be in [0, 1)", field="validation_fraction")
    parsed = parse_rows(jsonl=jsonl, rows=rows)
    splits = assign_splits(parsed, validation_fraction=validation_fraction, seed=seed)
    if "train" not in splits:
        raise ValidationFailed("the task set needs at least one training row", field="validation_fraction")
    with transaction.atomic():
        task_set = create_unique(
            lambda: TaskSet.objects.create(
                project=project,
                name=name,
                row_count=len(parsed),
                train_count=splits.count("train"),
                validation_count=splits.count("validation"),
            ),
            field="name",
            message=f"a task set named {name!r} already exists in this project",
        )
        TaskRow.objects.bulk_create(
            [
                TaskRow(task_set=task_set, index=i, split=split, data=row.data)
                for i, (row, split) in enumerate(zip(parsed, splits, strict=True))
            ],
            batch_size=500,
        )
    return task_set


def task_set_delete(*, task_set: TaskSet) -> None:
    delete_unless_used(task_set, "task set")
