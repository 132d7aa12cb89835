"""Reads for OpenAI's fine-tuning API (projects.api.fine_tuning): the team's files (task sets),
jobs (runs created through that API), a job's result run, checkpoints and events. Lookups by an id
the caller sent go through ``scoped``, so another team's reads as absent (the views' 404); the
functions taking a run take one already read through the caller's team."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from projects.models import Checkpoint, Project, Run, RunEvent, StepMetrics, TaskSet, Team
from projects.selectors._scoping import scoped


def fine_tuning_file(*, team: Team, number: int) -> TaskSet | None:
    """The team's task set ``file-<number>`` names."""
    return scoped(TaskSet, team).filter(pk=number).first()


def fine_tuning_files(*, team: Team, project: Project | None, ascending: bool) -> QuerySet[TaskSet]:
    """The team's files of ``project``, by id (``/v1/files``' ``order``)."""
    return scoped(TaskSet, team).filter(project=project).order_by("id" if ascending else "-id")


def fine_tuning_jobs(*, team: Team, project_name: str | None, metadata: dict[str, Any]) -> QuerySet[Run]:
    """The team's jobs (runs created through this API), newest first: those of the project named
    ``project_name`` when given, whose metadata holds every ``metadata`` pair (keys checked by the
    caller: they become lookups)."""
    jobs = scoped(Run, team).filter(fine_tuning__has_key="method")
    if project_name:
        jobs = jobs.filter(project__name=project_name)
    for name, value in metadata.items():
        jobs = jobs.filter(**{f"fine_tuning__metadata__{name}": value})
    return jobs.select_related("project").order_by("-id")


def fine_tuning_job_run(*, team: Team, number: int) -> Run | None:
    """The team's job run ``number`` (its result file is ``file-r<number>``)."""
    return scoped(Run, team).filter(pk=number, fine_tuning__has_key="method").first()


def job_checkpoints(*, run: Run) -> QuerySet[Checkpoint]:
    """The steps the job trained, newest first (its start, the untrained adapter, is not a result of it)."""
    return (
        Checkpoint.objects.filter(run=run, step__gt=run.start_step)
        .select_related("model__project")
        .order_by("-step")
    )


def job_latest_checkpoint(*, run: Run) -> Checkpoint | None:
    """The newest step the job trained (its ``fine_tuned_model`` once it has succeeded)."""
    return job_checkpoints(run=run).first()


def job_trained_tokens(*, run: Run) -> int:
    return int(sum(
        float(metrics.get("trainable_tokens", 0.0))
        for metrics in StepMetrics.objects.filter(run=run).values_list("metrics", flat=True)
    ))  # fmt: skip


def job_step_losses(*, run: Run) -> dict[int, StepMetrics]:
    """The job's step metrics by step, with only what a checkpoint's metrics show."""
    return {row.step: row for row in StepMetrics.objects.filter(run=run).only("step", "loss", "reward_mean")}


def job_events(*, run: Run) -> QuerySet[RunEvent]:
    return RunEvent.objects.filter(run=run).order_by("-id")
