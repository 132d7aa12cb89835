"""Reads. Every function takes the caller's team and returns only that team's rows."""

from __future__ import annotations

from typing import Any

from django.db.models import Model, QuerySet

from projects.errors import NotFound, ValidationFailed
from projects.models import (
    ApiKey,
    Checkpoint,
    Run,
    RunEvent,
    StepMetrics,
    Team,
    Trajectory,
)


def scoped(model: type[Model], team: Team) -> QuerySet:
    """All rows of ``model`` that belong to ``team``, through the model's ``TEAM_PATH``."""
    return model._default_manager.filter(**{model.TEAM_PATH: team})  # type: ignore[attr-defined]


def scoped_reference(model: type[Model], team: Team, value: Any, *, field: str) -> Any:
    """Resolve an id given in a request body; another team's id reads as not found (400 on that field)."""
    try:
        pk = int(value)
    except (TypeError, ValueError):
        raise ValidationFailed("must be an integer id", field=field) from None
    obj = scoped(model, team).filter(pk=pk).first()
    if obj is None:
        raise ValidationFailed(f"no {model._meta.verbose_name} with id {pk} in your team", field=field)
    return obj


def run_get(*, team: Team, run_id: int) -> Run:
    run = scoped(Run, team).filter(pk=run_id).first()
    if run is None:
        raise NotFound("run not found")
    return run


def run_events(*, run: Run, after: int | None = None, limit: int = 100) -> tuple[list[RunEvent], bool]:
    events = RunEvent.objects.filter(run=run).order_by("id")
    if after is not None:
        events = events.filter(id__gt=after)
    page = list(events[: limit + 1])
    return page[:limit], len(page) > limit


def run_step_metrics(*, run: Run) -> QuerySet[StepMetrics]:
    return StepMetrics.objects.filter(run=run).order_by("step")


def run_checkpoints(*, run: Run) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run=run).order_by("step")


def run_trajectories(*, run: Run, step: int | None = None) -> QuerySet[Trajectory]:
    trajectories = Trajectory.objects.filter(run=run)
    if step is not None:
        trajectories = trajectories.filter(step=step)
    return trajectories.order_by("step", "group_index", "sample_index")


def api_keys(*, team: Team) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(team=team).order_by("-id")
