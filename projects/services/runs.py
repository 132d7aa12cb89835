"""Runs: the run state machine, creation, cancellation, the worker's claim and heartbeat, failure
and orphan recovery.

Concurrency invariants:
- A run changes status only in ``run_transition`` under ``select_for_update``, following
  ``ALLOWED_TRANSITIONS``, and every transition inserts a RunEvent in the same transaction.
- Training work is enqueued with ``transaction.on_commit``, so a worker never sees a run that the
  web process has not committed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import TextField
from django.db.models.functions import Cast, Length
from django.utils import timezone

from projects.errors import Conflict, InvalidTransition, ValidationFailed
from projects.models import (
    Environment,
    EventLevel,
    EventType,
    RewardDefinition,
    Run,
    RunEvent,
    RunKind,
    RunStatus,
    TaskRow,
    TaskSet,
    TrainableModel,
    TrainingJob,
)
from projects.services import webhooks
from projects.services._common import config_invalid, error_text, worker_lost_reason
from training.config import ConfigError, TrainConfig

ACTIVE_STATUSES = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)
TERMINAL_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)

# The whole run state machine. ``running → running`` is a worker re-claiming an orphaned run.
ALLOWED_TRANSITIONS: dict[str, set[str]] = {
    RunStatus.QUEUED: {RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED},
    RunStatus.RUNNING: {
        RunStatus.RUNNING,
        RunStatus.PAUSED,
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
    },
    RunStatus.PAUSED: {RunStatus.QUEUED, RunStatus.CANCELLED, RunStatus.FAILED},
    RunStatus.SUCCEEDED: set(),
    RunStatus.FAILED: set(),
    RunStatus.CANCELLED: set(),
}


def run_platform_inputs(*, run: Run) -> tuple[TaskSet, Environment, RewardDefinition]:
    """A platform run's task set, environment and reward (a client run has none: its steps are
    the training jobs its client submits)."""
    if run.task_set is None or run.environment is None or run.reward is None:
        raise ValueError(f"run {run.pk} is a client run: it has no task set, environment or reward")
    return run.task_set, run.environment, run.reward


def run_event_add(
    *,
    run: Run,
    message: str,
    level: str = EventLevel.INFO,
    type: str = EventType.MESSAGE,
    data: dict | None = None,
) -> RunEvent:
    return RunEvent.objects.create(run=run, message=message, level=level, type=type, data=data or {})


def run_transition(
    *,
    run_id: int,
    to: str,
    message: str,
    level: str = EventLevel.INFO,
    data: dict[str, Any] | None = None,
    updates: dict[str, Any] | None = None,
) -> Run:
    """Move a run to ``to`` if the state machine allows it, recording an event. Raises
    InvalidTransition otherwise (callers that race, like cancel, catch it)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        if to not in ALLOWED_TRANSITIONS[run.status]:
            raise InvalidTransition(f"a {run.status} run cannot become {to}", field="status")
        previous = run.status
        run.status = to
        now = timezone.now()
        if to in TERMINAL_STATUSES:
            run.finished_at = now
        for key, value in (updates or {}).items():
            setattr(run, key, value)
        run.save()
        run_event_add(
            run=run,
            message=message,
            level=level,
            data={"from": previous, "to": to, **(data or {})},
        )
        webhooks.announce_run(run)
    return run


def _enqueue_run(run_id: int) -> None:
    from projects.jobs.queues import run_queue
    from projects.jobs.tasks import train_run

    # To its base model's work queue (a GPU class), looked up when sent (projects.jobs.queues).
    transaction.on_commit(lambda: train_run.apply_async(args=(run_id,), queue=run_queue(run_id)))


def run_create(
    *,
    model: TrainableModel,
    task_set: TaskSet,
    environment: Environment,
    reward: RewardDefinition,
    config: dict[str, Any] | None = None,
    created_by: User | None = None,
) -> Run:
    project = model.project
    for field, obj in (("task_set", task_set), ("environment", environment), ("reward", reward)):
        if obj.project_id != project.id:
            raise ValidationFailed("must belong to the same project as the model", field=field)
    if task_set.train_count == 0:
        raise ValidationFailed("the task set has no training rows", field="task_set")
    merged = {k: v for k, v in environment.sampling.items() if k != "stop"}
    merged.update(config or {})
    try:
        train_config = TrainConfig.from_dict(merged)
    except ConfigError as exc:
        raise config_invalid(exc, "config.") from exc
    _check_context(model=model, task_set=task_set, environment=environment, config=train_config)
    with transaction.atomic():
        # Lock the model row so two concurrent creates cannot both see "no active run" (a client's
        # training job takes the same lock: services.training_jobs).
        TrainableModel.objects.select_for_update().get(pk=model.pk)
        if Run.objects.filter(model=model, status__in=ACTIVE_STATUSES).exclude(kind=RunKind.CLIENT).exists():
            raise Conflict("this model already has an active run; cancel it or wait", code="model_busy")
        job = TrainingJob.objects.filter(model=model, status__in=("queued", "running")).order_by("id").first()
        if job is not None:
            raise Conflict(
                f"a client is training this model (training job {job.pk} is {job.status}, "
                "/v1/preview/training-jobs); one writer at a time: wait for it",
                code="model_busy",
            )
        run = Run.objects.create(
            project=project,
            model=model,
            task_set=task_set,
            environment=environment,
            reward=reward,
            config=train_config.to_dict(),
            total_steps=train_config.steps,
            created_by=created_by,
        )
        run_event_add(run=run, message=f"Run created: {train_config.steps} steps on model {model.name}")
        _enqueue_run(run.id)
    return run


# Prompts tokenised per run creation: the longest rows by characters (tokenising 100k rows on a
# web request would take seconds; a prompt's tokens grow with its characters).
CONTEXT_CHECK_ROWS = 16


def _check_context(
    *, model: TrainableModel, task_set: TaskSet, environment: Environment, config: TrainConfig
) -> None:
    """A run whose completions cannot fit the base model's context fails at creation with a 400
    naming the field and the limit, not at step 1 with no sign of life. The context is read from
    the base model's config without loading it (training.base_models.context_length); a model this
    host cannot read (a hub id on GPU workers) is not checked here."""
    from training.base_models import context_length, prompt_token_counts

    source = model.base_model.source
    context = context_length(source, settings.MODEL_CACHE_DIR)
    if context is None:
        return
    if config.max_new_tokens >= context:
        raise ValidationFailed(
            f"must be less than the base model's context of {context} tokens "
            f"({model.base_model.name}), got {config.max_new_tokens}",
            field="config.max_new_tokens",
        )
    rows = list(
        TaskRow.objects.filter(task_set=task_set)
        .annotate(size=Length(Cast("data", TextField())))
        .order_by("-size", "index")
        .only("index", "data")[:CONTEXT_CHECK_ROWS]
    )
    system = [{"role": "system", "content": environment.system_prompt}] if environment.system_prompt else []
    conversations = [
        system + (row.data.get("messages") or [{"role": "user", "content": str(row.data.get("prompt", ""))}])
        for row in rows
    ]
    counts = prompt_token_counts(source, settings.MODEL_CACHE_DIR, conversations)
    if not counts:
        return
    longest = max(range(len(counts)), key=counts.__getitem__)
    if counts[longest] + config.max_new_tokens > context:
        raise ValidationFailed(
            f"the prompt of task row {rows[longest].index} is {counts[longest]} tokens: with "
            f"max_new_tokens {config.max_new_tokens} it exceeds the base model's context of {context} "
            f"tokens ({model.base_model.name}); lower config.max_new_tokens to at most "
            f"{max(context - counts[longest], 0)} or shorten the prompt",
            field="config.max_new_tokens",
        )


def run_cancel(*, run: Run) -> Run:
    """Queued runs are cancelled at once; a running run stops before its next step."""
    if run.kind == RunKind.CLIENT:
        raise Conflict(
            "a client run's steps are the training jobs its client submits; it has nothing to cancel",
            code="client_run",
        )
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status in TERMINAL_STATUSES:
            raise InvalidTransition(f"the run already {locked.status}", field="status")
        if locked.status == RunStatus.RUNNING:
            if not locked.cancel_requested:
                locked.cancel_requested = True
                locked.save(update_fields=["cancel_requested"])
                run_event_add(
                    run=locked, message="Cancellation requested; the run stops before its next step"
                )
            return locked
    return run_transition(run_id=run.pk, to=RunStatus.CANCELLED, message="Run cancelled before it started")


def run_claim(
    *, run_id: int, worker: str, stale_after_s: float | None = None, max_attempts: int | None = None
) -> Run | None:
    """The idempotent first act of the training task.

    Returns the run if this worker now owns it: it was queued, or it is running but its worker has
    not sent a heartbeat for ``stale_after_s`` (died). A run that has already been claimed
    ``max_attempts`` times (default ``RUN_MAX_ATTEMPTS``) and lost its worker again is failed
    instead, with the reason, and None is returned: a run that kills its workers must not loop.
    Otherwise (a duplicate delivery, a finished or cancelled run, a live owner) returns None and
    changes nothing.
    """
    stale_after = timedelta(
        seconds=stale_after_s if stale_after_s is not None else settings.RUN_HEARTBEAT_TIMEOUT_S
    )
    cap = max_attempts if max_attempts is not None else settings.RUN_MAX_ATTEMPTS
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.kind == RunKind.CLIENT:  # a client run's work is its training jobs
            return None
        now = timezone.now()
        if run.status == RunStatus.QUEUED:
            if run.cancel_requested:
                return None
            message = f"Run started on worker {worker}"
        elif run.status == RunStatus.RUNNING and (
            run.heartbeat_at is None or now - run.heartbeat_at > stale_after
        ):
            if run.attempts >= cap:  # RUN_MAX_ATTEMPTS
                run_fail(run_id=run.pk, error=worker_lost_reason(run))
                return None
            message = f"Worker {run.worker or '?'} stopped sending heartbeats; resuming on {worker} from step {run.current_step}"
        else:
            return None
        updates = {"worker": worker, "heartbeat_at": now, "attempts": run.attempts + 1}
        if run.started_at is None:
            updates["started_at"] = now
        return run_transition(run_id=run.pk, to=RunStatus.RUNNING, message=message, updates=updates)


def run_heartbeat(*, run_id: int, worker: str) -> bool:
    """Refresh the heartbeat; False if this worker no longer owns the run (it must stop)."""
    updated = Run.objects.filter(pk=run_id, worker=worker, status=RunStatus.RUNNING).update(
        heartbeat_at=timezone.now()
    )
    return updated == 1


def run_set_start_step(*, run: Run, start_step: int) -> Run:
    Run.objects.filter(pk=run.pk).update(start_step=start_step, current_step=start_step)
    run.start_step = run.current_step = start_step
    return run


def run_fail(*, run_id: int, error: str) -> Run | None:
    message = error_text(error)
    try:
        return run_transition(
            run_id=run_id,
            to=RunStatus.FAILED,
            message=f"Run failed: {message}",
            level=EventLevel.ERROR,
            updates={"error": message},
        )
    except InvalidTransition:
        return None


def runs_requeue_orphaned(*, stale_after_s: float | None = None) -> list[int]:
    """Re-enqueue running runs whose worker stopped heartbeating; the claim decides who resumes."""
    stale_after = stale_after_s if stale_after_s is not None else settings.RUN_HEARTBEAT_TIMEOUT_S
    cutoff = timezone.now() - timedelta(seconds=stale_after)
    run_ids = list(
        Run.objects.filter(status=RunStatus.RUNNING, heartbeat_at__lt=cutoff)
        .exclude(kind=RunKind.CLIENT)
        .values_list("id", flat=True)
    )
    for run_id in run_ids:
        _enqueue_run(run_id)
    return run_ids
