"""Reads of reward definitions: the latest of each, their versions, and an example for the
editor's dry run."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from django.db.models import QuerySet

from projects.models import Project, RewardDefinition, Run, TaskRow, TaskSet, Team
from projects.selectors._scoping import scoped


def reward_definitions_latest(*, team: Team, project: Project) -> list[RewardDefinition]:
    """The newest version of each reward definition name in ``project``."""
    definitions = scoped(RewardDefinition, team).filter(project=project).order_by("name", "-version")
    latest: dict[str, RewardDefinition] = {}
    for definition in definitions:
        latest.setdefault(definition.name, definition)
    return list(latest.values())


def reward_definition_versions(*, definition: RewardDefinition) -> QuerySet[RewardDefinition]:
    return RewardDefinition.objects.filter(project=definition.project, name=definition.name).order_by(
        "-version"
    )


# `{{item.accept}}`, `{{ item.answers.0 }}`: the item paths a grader's templates read.
ITEM_VARIABLE = re.compile(r"\{\{\s*item\.([^{}\s]+)\s*\}\}")
EXAMPLE_TASK_SETS = 5  # task sets looked at for a row the example can be, each ...
EXAMPLE_ROWS = 50  # ... by its first rows
EXAMPLE_VALUE = "42"  # a made-up item's values: the editor's sample reads "The answer is 42"


@dataclass(frozen=True)
class RewardExample:
    """What the reward editor's "Try it" panel is prefilled with."""

    item: dict[str, Any]
    sample_text: str
    source: str  # where the item comes from, in words


def reward_item_paths(spec: Any) -> list[tuple[str, ...]]:
    """Every item path the spec's templates read (``{{item.accept}}`` → ``("accept",)``), once,
    in the order they appear. Code (a python grader's) is not read: a real row covers it."""
    paths: list[tuple[str, ...]] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            for match in ITEM_VARIABLE.finditer(value):
                path = tuple(match.group(1).split("."))
                if path not in paths:
                    paths.append(path)
        elif isinstance(value, dict):
            for inner in value.values():
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    walk(spec)
    return paths


def reward_example(*, definition: RewardDefinition) -> RewardExample:
    """An item the definition's grader can read, so the editor's dry run works as prefilled (a
    fixed ``{"answer": "42"}`` failed on the demo's ``{{item.accept}}``): the first row with every
    path the templates read, from the task sets of this reward's runs (newest first), then the
    project's; else an item made of those paths."""
    paths = reward_item_paths(definition.spec)
    versions = RewardDefinition.objects.filter(project=definition.project_id, name=definition.name)
    from_runs = Run.objects.filter(reward__in=versions).order_by("-pk").values_list("task_set_id", flat=True)
    in_project = (
        TaskSet.objects.filter(project=definition.project_id).order_by("-pk").values_list("pk", flat=True)
    )
    task_set_ids = list(dict.fromkeys([*from_runs[:EXAMPLE_TASK_SETS], *in_project[:EXAMPLE_TASK_SETS]]))
    for task_set_id in task_set_ids[:EXAMPLE_TASK_SETS]:
        rows = TaskRow.objects.filter(task_set_id=task_set_id).select_related("task_set").order_by("index")
        for row in rows[:EXAMPLE_ROWS]:
            found = row.data.get("item") if isinstance(row.data, dict) else None
            if isinstance(found, dict) and all(_has_path(found, path) for path in paths):
                answer = found.get("answer")
                sample = f"The answer is {answer if isinstance(answer, str) and answer else EXAMPLE_VALUE}"
                return RewardExample(found, sample, f"row {row.index} of task set “{row.task_set.name}”")
    made: dict[str, Any] = {}
    for path in paths:
        node = made
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node.setdefault(path[-1], EXAMPLE_VALUE)
    source = "made up from the spec's {{item.…}} fields" if paths else "empty: the spec reads no item field"
    return RewardExample(made, f"The answer is {EXAMPLE_VALUE}", source)


def _has_path(item: dict[str, Any], path: tuple[str, ...]) -> bool:
    """Whether a template can look ``path`` up in ``item`` (training.rewards.templates' walk: dict
    keys, and integer indexes on lists)."""
    value: Any = item
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdecimal() and int(key) < len(value):
            value = value[int(key)]
        else:
            return False
    return True
