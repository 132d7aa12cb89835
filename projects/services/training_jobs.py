"""Client-driven training (OpenPipe ART's ServerlessBackend protocol, ``/v1/preview/``): models a
client registers, their client run, training jobs and their events, checkpoint deletion, logs.

Concurrency invariants:
- One writer per model: a training job is created, and a platform run (services.runs.run_create),
  only under ``select_for_update`` of the model row, each refusing while the other is active.
- Jobs of one model run in submit order: ``training_job_claim`` refuses a job while an earlier one
  of its model is unfinished, and every job that ends enqueues the next (after commit).
- A job's step (checkpoint, metrics, trajectories, the client run's progress, ``gradient_step``
  and ``training_ended``) is recorded in ONE transaction, conditional on this worker owning the
  job, after the checkpoint files are complete: the client never hears ``training_ended`` before
  the gateway can serve the new checkpoint, and a step is never counted twice.
- A job changes status only in ``training_job_transition`` under ``select_for_update``, following
  ``TRAINING_JOB_TRANSITIONS``; work is enqueued with ``transaction.on_commit``.
- A job of a schedule (``TrainingJob.schedule``) that fails cancels the schedule's later unfinished
  jobs in the same transaction: they would train on a checkpoint the schedule did not plan.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from projects import selectors
from projects.errors import Conflict, ValidationFailed
from projects.formatting import format_number
from projects.models import (
    Checkpoint,
    ClientLog,
    EventLevel,
    EventType,
    Run,
    StepMetrics,
    TrainableModel,
    TrainingJob,
    TrainingJobEvent,
    TrainingJobEventType,
    TrainingJobStatus,
)
from projects.services import webhooks
from projects.services._common import error_text, jsonb_safe
from projects.services.client_models import UNFINISHED, client_run_of, platform_run_active
from projects.services.runs import run_event_add
from projects.services.steps import TrajectoryRecord, step_rows_write
from projects.services.transitions import Machine, work_transition
from projects.storage import StoredObject
from training.config import ConfigError, TrainConfig
from training.recipes.art_config import ArtOptions, art_job_config
from training.runs.art_groups import GroupError, parse_groups

logger = logging.getLogger(__name__)

# A job's config: its TrainConfig's keys, and ART's options (training.recipes.art_config) under this one.
ART_OPTIONS = "art"

TRAINING_JOB_TRANSITIONS: dict[str, set[str]] = {
    TrainingJobStatus.QUEUED: {TrainingJobStatus.RUNNING, TrainingJobStatus.FAILED},
    # running → running: a worker taking over a job whose worker stopped heartbeating.
    TrainingJobStatus.RUNNING: {
        TrainingJobStatus.RUNNING,
        TrainingJobStatus.SUCCEEDED,
        TrainingJobStatus.FAILED,
    },
    TrainingJobStatus.SUCCEEDED: set(),
    TrainingJobStatus.FAILED: set(),
}


# ----------------------------------------------------------------------------- checkpoints


# Deleting checkpoints (ART's delete_checkpoints) is services.checkpoints.checkpoints_delete.


# ----------------------------------------------------------------------------- training jobs


def training_job_config(experimental_config: Any) -> tuple[TrainConfig, ArtOptions]:
    """A job's settings from ART's ``experimental_config`` (training.recipes.art_config, the one
    place an empty learning rate is filled in); a bad key is a 400 naming
    ``experimental_config.<key>``."""
    try:
        return art_job_config(experimental_config)
    except ConfigError as exc:
        field = (
            "experimental_config"
            if exc.field == "experimental_config"
            else f"experimental_config.{exc.field}"
        )
        raise ValidationFailed(exc.message, field=field) from exc


def training_job_create(
    *,
    model: TrainableModel,
    trajectory_groups: Any,
    experimental_config: Any = None,
    created_by: User | None = None,
) -> TrainingJob:
    """Queue one step on ``trajectory_groups`` (checked here: a bad upload is a 400 naming its
    place); 409 while a platform run trains the model."""
    config, options = training_job_config(experimental_config)
    try:
        groups = parse_groups(
            trajectory_groups, allow_without_logprobs=options.allow_training_without_logprobs
        )
    except GroupError as exc:
        raise ValidationFailed(exc.message, field=exc.path) from exc
    with transaction.atomic():
        TrainableModel.objects.select_for_update().get(pk=model.pk)
        run = platform_run_active(model=model)
        if run is not None:
            raise Conflict(
                f"run #{run.pk} is {run.status} on this model: one writer at a time; cancel it or wait",
                code="model_busy",
            )
        client_run = client_run_of(model)
        job = TrainingJob.objects.create(
            model=model,
            run=client_run,
            groups=jsonb_safe(trajectory_groups),
            # Resolved here, read as stored by the worker: the model's devices as of this job.
            config={
                **replace(config, devices=model.devices, fsdp=model.fsdp).to_dict(),
                ART_OPTIONS: options.to_dict(),
            },
            created_by=created_by,
        )
        trajectories = sum(len(group.trajectories) for group in groups)
        run_event_add(
            run=client_run,
            message=f"Training job {job.pk} queued: {len(groups)} groups, {trajectories} trajectories",
            data={"training_job": job.pk},
        )
        _enqueue(job.pk)
    return job


def _enqueue(job_id: int) -> None:
    from projects.jobs.queues import training_job_queue
    from projects.jobs.tasks import train_job

    # To its base model's work queue, like a run (projects.jobs.queues).
    transaction.on_commit(lambda: train_job.apply_async(args=(job_id,), queue=training_job_queue(job_id)))


def _enqueue_next(model_id: int) -> None:
    following = (
        TrainingJob.objects.filter(model_id=model_id, status=TrainingJobStatus.QUEUED)
        .order_by("id")
        .values_list("id", flat=True)
        .first()
    )
    if following is not None:
        _enqueue(following)


def training_job_event_add(*, job: TrainingJob, type: str, message: str, data: dict | None = None,
                           level: str = EventLevel.INFO) -> TrainingJobEvent:  # fmt: skip
    return TrainingJobEvent.objects.create(job=job, type=type, message=message, data=data or {}, level=level)


TRAINING_JOB_MACHINE: Machine[TrainingJob] = Machine(
    TrainingJob,
    TRAINING_JOB_TRANSITIONS,
    frozenset({TrainingJobStatus.SUCCEEDED, TrainingJobStatus.FAILED}),
    "training job",
)


def training_job_transition(*, job_id: int, to: str, updates: dict[str, Any] | None = None) -> TrainingJob:
    """Move a job to ``to`` if TRAINING_JOB_TRANSITIONS allows it (services.transitions)."""
    return work_transition(
        TRAINING_JOB_MACHINE, pk=job_id, to=to, updates=updates,
        announce=lambda job, previous: webhooks.announce_training_job(job),
    )  # fmt: skip


def training_job_claim(*, job_id: int, worker: str, stale_after_s: float | None = None) -> TrainingJob | None:
    """The idempotent first act of the job's task: the job if this worker now owns it (queued, or
    running with a stale heartbeat), else None. A job whose model has an earlier unfinished job
    waits: that one enqueues it when it ends."""
    stale_after = timedelta(
        seconds=settings.RUN_HEARTBEAT_TIMEOUT_S if stale_after_s is None else stale_after_s
    )
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().filter(pk=job_id).first()
        if job is None:
            return None
        now = timezone.now()
        taken_over = job.status == TrainingJobStatus.RUNNING and (
            job.heartbeat_at is None or now - job.heartbeat_at > stale_after
        )
        if job.status != TrainingJobStatus.QUEUED and not taken_over:
            return None
        if TrainingJob.objects.filter(model_id=job.model_id, status__in=UNFINISHED, pk__lt=job.pk).exists():
            return None
        updates = {"worker": worker, "heartbeat_at": now, "attempts": job.attempts + 1}
        if job.started_at is None:
            updates["started_at"] = now
        previous = job.worker
        job = training_job_transition(job_id=job.pk, to=TrainingJobStatus.RUNNING, updates=updates)
        message = (
            f"Training job {job.pk}: worker {previous or '?'} stopped sending heartbeats; redoing it on {worker}"
            if taken_over
            else f"Training job {job.pk} started on worker {worker}"
        )
        run_event_add(run=job.run, message=message, data={"training_job": job.pk})
    return job


def training_job_heartbeat(*, job_id: int, worker: str) -> bool:
    """Refresh the heartbeat; False once this worker no longer owns the job."""
    return (
        TrainingJob.objects.filter(pk=job_id, worker=worker, status=TrainingJobStatus.RUNNING).update(
            heartbeat_at=timezone.now()
        )
        == 1
    )


def training_job_started(*, job: TrainingJob, num_sequences: int) -> None:
    """The ``training_started`` event, once per job (a job redone after a lost worker keeps it)."""
    if not TrainingJobEvent.objects.filter(job=job, type=TrainingJobEventType.TRAINING_STARTED).exists():
        training_job_event_add(
            job=job,
            type=TrainingJobEventType.TRAINING_STARTED,
            message=f"Training started: {num_sequences} gradient step(s)",
            data={"num_sequences": num_sequences},
        )


def training_job_finish(
    *,
    job: TrainingJob,
    worker: str,
    step: int,
    checkpoint_path: str,
    metrics: dict[str, Any],
    events: list[dict[str, float]],
    stored: StoredObject | None = None,
    trajectories: list[TrajectoryRecord],
) -> bool:
    """Record the job's step and end it, in one transaction (see the module's invariants).
    False (nothing written) if this worker no longer owns the job."""
    with transaction.atomic():
        locked = TrainingJob.objects.select_for_update().get(pk=job.pk)
        if locked.status != TrainingJobStatus.RUNNING or locked.worker != worker:
            return False
        run = Run.objects.select_for_update().get(pk=locked.run_id)
        if StepMetrics.objects.filter(run=run, step=step).exists():
            return False
        metrics = jsonb_safe(metrics)
        step_rows_write(
            run=run,
            step=step,
            metrics=metrics,
            trajectories=trajectories,
            path=checkpoint_path,
            stored=stored,
        )
        run.current_step = step
        run.total_steps = step - run.start_step
        run.heartbeat_at = timezone.now()
        run.config = {k: v for k, v in locked.config.items() if k != ART_OPTIONS}
        run.save(update_fields=["current_step", "total_steps", "heartbeat_at", "config"])
        run_event_add(
            run=run,
            message=f"Step {step} (training job {locked.pk}): reward {metrics.get('reward_mean', 0):.3f}, "
            f"loss {format_number(metrics.get('loss'))}, {int(metrics.get('num_groups_trainable', 0))} of "
            f"{int(metrics.get('num_groups_submitted', 0))} groups trainable",
            type=EventType.METRICS,
            data={"step": step, "training_job": locked.pk, **metrics},
        )
        training_job_transition(
            job_id=locked.pk,
            to=TrainingJobStatus.SUCCEEDED,
            updates={"step": step, "metrics": metrics, "groups": []},  # the trajectories are stored now
        )
        for index, data in enumerate(events, start=1):  # one per optimizer step, as ART's backends send
            training_job_event_add(
                job=locked,
                type=TrainingJobEventType.GRADIENT_STEP,
                message=f"Step {step}: optimizer step {index} of {len(events)}",
                data=data,
            )
        training_job_event_add(
            job=locked,
            type=TrainingJobEventType.TRAINING_ENDED,
            message=f"Training ended: checkpoint step {step} is served",
            data={"step": step},
        )
        _enqueue_next(locked.model_id)
    return True


# A job ended before it trained (its schedule cancelled, or an earlier step of it failed): failed,
# with an error that starts so, since ART's client knows no other end than training_failed.
CANCELLED = "cancelled: "


def _training_job_end(*, job_id: int, message: str) -> TrainingJob:
    """Fail the (unfinished, locked) job with ``message``: the client's training_failed, the run's event.
    A worker still on it loses its heartbeat and its step is never recorded (``training_job_finish``)."""
    job = training_job_transition(job_id=job_id, to=TrainingJobStatus.FAILED, updates={"error": message})
    training_job_event_add(
        job=job,
        type=TrainingJobEventType.TRAINING_FAILED,
        message=f"Training failed: {message}",
        level=EventLevel.ERROR,
        data={"error_message": message},
    )
    run_event_add(run=job.run, message=f"Training job {job.pk} failed: {message}", level=EventLevel.ERROR)
    return job


def training_job_fail(*, job_id: int, error: str, worker: str | None = None) -> TrainingJob | None:
    """End the job with ``training_failed`` (the client raises it), and with it its schedule's later
    unfinished steps; None if it already ended or another worker took it over."""
    message = error_text(error)
    with transaction.atomic():
        job = TrainingJob.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.status not in UNFINISHED or (worker is not None and job.worker != worker):
            return None
        job = _training_job_end(job_id=job.pk, message=message)
        if job.schedule_id is not None:
            step = TrainingJob.objects.filter(schedule_id=job.schedule_id, pk__lte=job.pk).count()
            ended = "was cancelled" if message.startswith(CANCELLED) else "failed"
            _schedule_jobs_end(schedule_id=job.schedule_id, after=job.pk,
                               message=error_text(f"{CANCELLED}step {step} of this schedule {ended}: {message}"))  # fmt: skip
        _enqueue_next(job.model_id)
    return job


def _schedule_jobs_end(*, schedule_id: int, after: int, message: str) -> None:
    """Fail the schedule's unfinished jobs after job ``after``, each locked in id order."""
    later = TrainingJob.objects.filter(schedule_id=schedule_id, pk__gt=after, status__in=UNFINISHED)
    for job_id in later.order_by("id").values_list("id", flat=True):
        if TrainingJob.objects.select_for_update().get(pk=job_id).status in UNFINISHED:
            _training_job_end(job_id=job_id, message=message)


def training_schedule_cancel(*, schedule: TrainingJob) -> list[TrainingJob]:
    """Cancel a schedule (named by its first job): its unfinished jobs end as cancelled, a running
    one as ``training_job_fail`` ends it. Idempotent: a schedule with nothing left to run is left
    as it is. Under the model's row, as ``services.run_control.client_run_end`` takes it. The
    schedule's jobs in step order."""
    with transaction.atomic():
        TrainableModel.objects.select_for_update().get(pk=schedule.model_id)
        _schedule_jobs_end(schedule_id=schedule.pk, after=0,
                           message=f"{CANCELLED}training schedule {schedule.pk} was cancelled")  # fmt: skip
        _enqueue_next(schedule.model_id)
        return selectors.training_schedule_jobs(schedule=schedule)


def training_jobs_requeue_orphaned(*, stale_after_s: float | None = None) -> list[int]:
    """Re-enqueue running jobs whose worker stopped heartbeating, and each model's first queued
    job if it has waited that long (a lost message); the claim decides who runs them."""
    stale_after = settings.RUN_HEARTBEAT_TIMEOUT_S if stale_after_s is None else stale_after_s
    cutoff = timezone.now() - timedelta(seconds=stale_after)
    orphaned = set(
        TrainingJob.objects.filter(status=TrainingJobStatus.RUNNING, heartbeat_at__lt=cutoff).values_list(
            "id", flat=True
        )
    )
    waiting = TrainingJob.objects.filter(status=TrainingJobStatus.QUEUED, created_at__lt=cutoff).order_by(
        "id"
    )
    heads: dict[int, int] = {}
    for job_id, model_id in waiting.values_list("id", "model_id"):
        heads.setdefault(model_id, job_id)
    job_ids = sorted(orphaned | set(heads.values()))
    for job_id in job_ids:
        _enqueue(job_id)
    return job_ids


# ----------------------------------------------------------------------------- logs


def client_log_record(*, model: TrainableModel, split: Any, trajectory_groups: Any) -> ClientLog:
    """Keep groups a client logged (a validation split, say), checked like a training upload but
    without asking for logprobs."""
    if not isinstance(split, str) or not split or len(split) > 32:
        raise ValidationFailed("must be a split name (1-32 characters), e.g. val or train", field="split")
    try:
        groups = parse_groups(trajectory_groups, for_training=False)
    except GroupError as exc:
        raise ValidationFailed(exc.message, field=exc.path) from exc
    rewards = [t.reward for group in groups for t in group.trajectories]
    latest = Checkpoint.objects.filter(model=model).order_by("-step").values_list("step", flat=True).first()
    return ClientLog.objects.create(
        model=model,
        split=split,
        step=latest or 0,
        groups=jsonb_safe(trajectory_groups),
        trajectory_count=len(rewards),
        reward_mean=statistics.fmean(rewards) if rewards else None,
    )
