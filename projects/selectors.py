"""Reads. Every function takes the caller's team and returns only that team's rows."""

from __future__ import annotations

from typing import Any

from django.db.models import Model, Q, QuerySet

from projects.errors import NotFound, ValidationFailed
from projects.models import (
    ApiKey,
    Checkpoint,
    Evaluation,
    EvaluationEvent,
    EvaluationSample,
    JudgeEndpoint,
    Membership,
    Project,
    RewardDefinition,
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


# --- dashboard reads (frontend/) ------------------------------------------------------------


def memberships_of(*, user: Any) -> QuerySet[Membership]:
    """The teams a signed-in person belongs to, by team name (the dashboard's team switcher)."""
    return Membership.objects.select_related("team").filter(user=user).order_by("team__name")


def team_members(*, team: Team) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(team=team).order_by("user__username")


def runs_search(
    *,
    team: Team,
    project_id: int | None = None,
    model_id: int | None = None,
    status: str | None = None,
    text: str = "",
) -> QuerySet[Run]:
    """The team's runs, newest first; ``text`` matches the model, project or creator name."""
    runs = scoped(Run, team).select_related("project", "model", "created_by")
    if project_id is not None:
        runs = runs.filter(project_id=project_id)
    if model_id is not None:
        runs = runs.filter(model_id=model_id)
    if status:
        runs = runs.filter(status=status)
    if text:
        runs = runs.filter(
            Q(model__name__icontains=text)
            | Q(project__name__icontains=text)
            | Q(created_by__username__icontains=text)
        )
    return runs.order_by("-id")


def trajectory_steps(*, run: Run) -> list[int]:
    return list(Trajectory.objects.filter(run=run).values_list("step", flat=True).distinct().order_by("step"))


def trajectory_group_indexes(*, run: Run, step: int) -> list[int]:
    return list(
        Trajectory.objects.filter(run=run, step=step)
        .values_list("group_index", flat=True)
        .distinct()
        .order_by("group_index")
    )


def trajectory_group(*, run: Run, step: int, group_index: int) -> list[Trajectory]:
    """One group's trajectories, best reward first (the trajectory viewer's columns)."""
    return list(
        Trajectory.objects.filter(run=run, step=step, group_index=group_index).order_by(
            "-reward", "sample_index"
        )
    )


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


def run_evaluations(*, run: Run) -> QuerySet[Evaluation]:
    return Evaluation.objects.filter(run=run).select_related("checkpoint").order_by("step", "id")


def checkpoint_evaluations(*, checkpoint: Checkpoint) -> QuerySet[Evaluation]:
    return Evaluation.objects.filter(checkpoint=checkpoint).order_by("-id")


def run_recent_events(*, run: Run, limit: int = 50) -> list[RunEvent]:
    """The newest ``limit`` events, newest first (the run page's log)."""
    return list(RunEvent.objects.filter(run=run).order_by("-id")[:limit])


def judge_endpoints(*, team: Team) -> QuerySet[JudgeEndpoint]:
    """The team's OpenAI-compatible endpoints (judges, scenario writers, evaluation references)."""
    return JudgeEndpoint.objects.filter(team=team).order_by("name")


def evaluation_recent_events(*, evaluation: Evaluation, limit: int = 50) -> list[EvaluationEvent]:
    """The newest ``limit`` events, newest first (the evaluation page's log)."""
    return list(EvaluationEvent.objects.filter(evaluation=evaluation).order_by("-id")[:limit])


def evaluation_sample_row_indexes(*, evaluation: Evaluation) -> list[int]:
    """The task rows an evaluation has samples for, in order (the samples view pages by row)."""
    return list(
        EvaluationSample.objects.filter(evaluation=evaluation)
        .values_list("task_row_index", flat=True)
        .distinct()
        .order_by("task_row_index")
    )


def evaluation_samples_of_rows(
    *, evaluation: Evaluation, row_indexes: list[int]
) -> QuerySet[EvaluationSample]:
    return EvaluationSample.objects.filter(evaluation=evaluation, task_row_index__in=row_indexes).order_by(
        "task_row_index", "side", "sample_index"
    )
