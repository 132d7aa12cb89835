"""Reads for client-driven training (``/v1/preview/``): a model's client run, its checkpoints in
either order, a training job's events, a training schedule's jobs. The callers (projects.api.preview) hold rows already read
through the caller's team."""

from __future__ import annotations

from django.db.models import QuerySet

from projects.models import Checkpoint, Run, RunKind, TrainableModel, TrainingJob, TrainingJobEvent


def client_run(*, model: TrainableModel) -> Run | None:
    return Run.objects.filter(model=model, kind=RunKind.CLIENT).order_by("-id").first()


def model_checkpoints(*, model: TrainableModel, descending: bool = False) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(model=model).order_by("-step" if descending else "step")


def training_job_events(*, job: TrainingJob) -> QuerySet[TrainingJobEvent]:
    return TrainingJobEvent.objects.filter(job=job).order_by("id")


def training_schedule_jobs(*, schedule: TrainingJob) -> list[TrainingJob]:
    """A schedule's jobs (``schedule``: its first job, read through the caller's team) in step order."""
    return list(TrainingJob.objects.filter(schedule_id=schedule.pk).order_by("id"))
