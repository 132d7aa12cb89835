"""Reads of task rows, as the training core and the evaluations take them."""

from __future__ import annotations

from typing import Any

from projects.models import TaskRow, TaskSet


def task_set_rows(*, task_set: TaskSet, split: str, max_rows: int | None = None) -> list[dict[str, Any]]:
    """A split's rows (``"all"``: every row) as ``{"index", "data"}`` in index order, the first
    ``max_rows`` of them when given."""
    rows = TaskRow.objects.filter(task_set=task_set).order_by("index")
    if split != "all":
        rows = rows.filter(split=split)
    if max_rows is not None:
        rows = rows[:max_rows]
    return [{"index": row.index, "data": row.data} for row in rows]
