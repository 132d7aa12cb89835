"""Runs: the run state machine, creation (and where it starts), the worker's claim and heartbeat,
failure and orphan recovery (cancel, pause and resume: services.run_control; forks:
services.run_forks).

Concurrency invariants:
- A run changes status only in ``run_transition`` under ``select_for_update``, following
  ``ALLOWED_TRANSITIONS``, and every transition inserts a RunEvent in the same transaction.
- Training work is enqueued with ``transaction.on_commit``, so a worker never sees a run that the
  web process has not committed.
- Pause is a request the worker honours between steps (``pause_requested``, read by the loop's
  ``should_stop`` exactly as a cancellation is); the worker then moves the run to ``paused`` and
  gives up its claim. Resume queues it again, and the next claim continues from the last recorded
  checkpoint by the same path as a crash-resume.

Why one module of this length: a run's life (creation and its checks, the claim, the heartbeat,
failure and orphan recovery) under the state machine and invariants below, which each part relies
on.
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
    CLIENT_KINDS,
    WORKER_KINDS,
    Checkpoint,
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
    TinkerFuture,
    TinkerFutureStatus,
    TrainableModel,
    TrainingJob,
)
from projects.services import webhooks
from projects.services._common import config_invalid, error_text, worker_lost_reason
from projects.services.transitions import Machine, work_transition
from training.config import ConfigError, TrainConfig
from training.model_files import hidden_size, resolve_config

ACTIVE_STATUSES = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)
TERMINAL_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)

# The whole run state machine. ``running → running`` is a worker re-claiming an orphaned run.
ALLOWED_TRANSITIONS: dict[str, set[str]] = {
    RunStatus.QUEUED: {RunStatus.RUNNING, RunStatus.PAUSED, RunStatus.CANCELLED, RunStatus.FAILED},
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


RUN_MACHINE: Machine[Run] = Machine(Run, ALLOWED_TRANSITIONS, frozenset(TERMINAL_STATUSES), "run")


def run_transition(
    *,
    run_id: int,
    to: str,
    message: str,
    level: str = EventLevel.INFO,
    data: dict[str, Any] | None = None,
    updates: dict[str, Any] | None = None,
) -> Run:
    """Move a run to ``to`` if the state machine allows it, recording an event (services.transitions).
    Raises InvalidTransition otherwise (callers that race, like cancel, catch it)."""

    def announce(run: Run, previous: str) -> None:
        run_event_add(
            run=run, message=message, level=level, data={"from": previous, "to": to, **(data or {})}
        )
        webhooks.announce_run(run)

    return work_transition(RUN_MACHINE, pk=run_id, to=to, updates=updates, announce=announce)


def _enqueue_run(run_id: int) -> None:
    from projects.jobs.queues import run_queue
    from projects.jobs.tasks import train_run

    # To its base model's work queue (a GPU class), looked up when sent (projects.jobs.queues).
    transaction.on_commit(lambda: train_run.apply_async(args=(run_id,), queue=run_queue(run_id)))


START_FROM_LATEST, START_FROM_BASE = "latest", "base"


def run_create(
    *,
    model: TrainableModel,
    task_set: TaskSet,
    environment: Environment,
    reward: RewardDefinition,
    config: dict[str, Any] | None = None,
    created_by: User | None = None,
    start_from: str | int = START_FROM_LATEST,
    forked_from: Checkpoint | None = None,
    kind: str = RunKind.PLATFORM,
) -> Run:
    """Create a queued run and enqueue it after commit. ``kind``: platform (GRPO), sft or dpo
    (every row of the task set must carry the targets: ``training.recipes.supervised.row_problem``).

    ``start_from`` says where the run starts, fixed here (under the model's lock) and said in the
    run's first event: ``"latest"`` (the default) continues from the model's latest checkpoint, or
    from a fresh adapter when it has none; ``"base"`` asks for a fresh adapter and is a 409 on a
    model that has trained past step 0 (its steps 1..N exist: make a new model, or fork from step
    0); a checkpoint id of this model pins the start to that checkpoint, a 409 unless it is still
    the model's latest (a model's steps are one line: continuing from an older step is a fork).
    """
    project = model.project
    for field, obj in (("task_set", task_set), ("environment", environment), ("reward", reward)):
        if obj.project_id != project.id:
            raise ValidationFailed("must belong to the same project as the model", field=field)
    if task_set.train_count == 0:
        raise ValidationFailed("the task set has no training rows", field="task_set")
    if kind not in WORKER_KINDS:
        raise ValidationFailed(f"must be one of {', '.join(WORKER_KINDS)}", field="kind")
    if kind != RunKind.PLATFORM:
        _check_rows(task_set=task_set, kind=kind)
    train_config = run_config_check(
        config=config or {}, kind=kind, sampling=environment.sampling, model=model
    )
    _check_context(model=model, task_set=task_set, environment=environment, config=train_config)
    rate_note = ""
    if (config or {}).get("learning_rate") is None:  # the default for the base model's width, stored explicit
        width = hidden_size(model.base_model.source, settings.MODEL_CACHE_DIR)
        objective = "grpo" if kind == RunKind.PLATFORM else str(kind)
        rate_note = f"; learning rate {train_config.learning_rate:g}, the {objective} default for " + (
            f"a base model of width {width}" if width else "a base model whose width this host cannot read"
        )
    with transaction.atomic():
        # Lock the model row so two concurrent creates cannot both see "no active run" (a client's
        # training job takes the same lock: services.training_jobs).
        TrainableModel.objects.select_for_update().get(pk=model.pk)
        if (
            Run.objects.filter(model=model, status__in=ACTIVE_STATUSES)
            .exclude(kind__in=CLIENT_KINDS)
            .exists()
        ):
            raise Conflict("this model already has an active run; cancel it or wait", code="model_busy")
        pending = TinkerFuture.objects.filter(model__model=model, status=TinkerFutureStatus.PENDING).first()
        if pending is not None:  # a Tinker client's request still to run: wait for it (tinker_future_submit)
            raise Conflict(
                f"a Tinker training client's request {pending.pk} ({pending.kind}) on this model has not "
                "run yet; one writer at a time: wait for its future",
                code="model_busy",
            )
        job = TrainingJob.objects.filter(model=model, status__in=("queued", "running")).order_by("id").first()
        if job is not None:
            raise Conflict(
                f"a client is training this model (training job {job.pk} is {job.status}, "
                "/v1/preview/training-jobs); one writer at a time: wait for it",
                code="model_busy",
            )
        start = _start_checkpoint(model=model, start_from=start_from)
        start_step = start.step if start is not None else 0
        run = Run.objects.create(
            kind=kind,
            project=project,
            model=model,
            task_set=task_set,
            environment=environment,
            reward=reward,
            config=train_config.to_dict(),
            total_steps=train_config.steps,
            created_by=created_by,
            start_step=start_step,
            current_step=start_step,
            forked_from=forked_from,
        )
        run_event_add(
            run=run,
            message=f"Run created: {train_config.steps} steps on model {model.name}, "
            f"{run_start_text(run=run)}{rate_note}",
            data={
                "start_from": start_from,
                "start_step": start_step,
                "checkpoint": start.pk if start is not None else None,
            },
        )
        _enqueue_run(run.id)
    return run


def run_config_check(
    *,
    config: dict[str, Any],
    kind: str = RunKind.PLATFORM,
    sampling: dict[str, Any] | None = None,
    model: TrainableModel | None = None,
) -> TrainConfig:
    """The TrainConfig a run of ``kind`` on ``model`` trains with, resolved once
    (TrainConfig.resolved: checked against the run's objective, an empty learning rate filled in
    for the base model's width): the environment's ``sampling`` settings, then ``config`` over
    them. run_create stores it so; the worker reads it as stored (projects.jobs.runs). A 400 lists
    every bad field (``config.<name>``). Without ``model`` (the dashboard's run form, which calls
    it next to the upload's row check so that one submit shows every problem) it is checked only:
    its learning rate stays as given."""
    merged = {k: v for k, v in (sampling or {}).items() if k != "stop"}
    merged.update(config)
    objective = "grpo" if kind == RunKind.PLATFORM else str(kind)
    try:
        train_config = TrainConfig.from_dict(merged)
        if model is None:
            train_config.check_objective(objective)
            return train_config
        return resolve_config(train_config, source=model.base_model.source,
                              cache_dir=settings.MODEL_CACHE_DIR, objective=objective)  # fmt: skip
    except ConfigError as exc:
        raise config_invalid(exc, "config.") from exc


def _check_rows(*, task_set: TaskSet, kind: str) -> None:
    """An SFT or DPO run's rows must carry its targets: a 400 naming the first that does not."""
    from training.recipes.supervised import row_problem

    for index, data in TaskRow.objects.filter(task_set=task_set).values_list("index", "data").iterator():
        problem = row_problem(data, kind)
        if problem:
            raise ValidationFailed(
                f"task row {index} cannot train a {kind} run: it {problem}", field="task_set"
            )


def run_start_text(*, run: Run) -> str:
    """Where ``run`` starts, in words (its first event and its page say it)."""
    if run.forked_from_id is not None and run.start_step == 0:
        source = run.forked_from
        assert source is not None
        return f"starting from step 0, a copy of {source.model.name}:{source.step} (forked)"
    if run.start_step:
        return f"starting from checkpoint step {run.start_step}"
    return "starting from the base model (a fresh adapter)"


def _start_checkpoint(*, model: TrainableModel, start_from: str | int) -> Checkpoint | None:
    """The checkpoint a new run on ``model`` starts from (None: a fresh adapter); see run_create."""
    latest = Checkpoint.objects.filter(model=model).order_by("-step").first()
    if start_from == START_FROM_LATEST:
        return latest
    if start_from == START_FROM_BASE:
        if latest is not None and latest.step > 0:
            raise Conflict(
                f"model {model.name} has trained to checkpoint step {latest.step}; a fresh adapter "
                "needs a model without steps past 0: create a new model, or fork a run of this one "
                'from step 0, or use start_from "latest"',
                field="start_from",
                code="model_has_checkpoints",
            )
        return latest  # None, or step 0: the untrained adapter, whose outputs are the base model's
    if isinstance(start_from, bool) or not isinstance(start_from, int):
        raise ValidationFailed('must be "latest", "base" or a checkpoint id of the model', field="start_from")
    checkpoint = Checkpoint.objects.filter(model=model, pk=start_from).first()
    if checkpoint is None:
        raise ValidationFailed(f"model {model.name} has no checkpoint {start_from}", field="start_from")
    if latest is not None and checkpoint.step != latest.step:
        raise Conflict(
            f"checkpoint {start_from} is step {checkpoint.step} of model {model.name}, whose latest is "
            f"step {latest.step}: a run continues a model from its latest checkpoint; to train on "
            f"from step {checkpoint.step}, fork its run from that step",
            field="start_from",
            code="not_latest_checkpoint",
        )
    return checkpoint


# Prompts tokenised per run creation: the longest rows by characters (tokenising 100k rows on a
# web request would take seconds; a prompt's tokens grow with its characters).
CONTEXT_CHECK_ROWS = 16


def _check_context(
    *, model: TrainableModel, task_set: TaskSet, environment: Environment, config: TrainConfig
) -> None:
    """A run whose completions cannot fit the base model's context fails at creation with a 400
    naming the field and the limit, not at step 1 with no sign of life. The context is read from
    the base model's config without loading it (training.model_files.context_length); a model this
    host cannot read (a hub id on GPU workers) is not checked here."""
    from training.base_models import prompt_token_counts
    from training.model_files import context_length

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


def _refuse_client_run(run: Run, what: str) -> None:
    if run.kind in CLIENT_KINDS:
        raise Conflict(
            f"a client run's steps are the training jobs its client submits; it has nothing to {what}",
            code="client_run",
        )


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
        if run is None or run.kind in CLIENT_KINDS:  # a client run's work is its training jobs
            return None
        now = timezone.now()
        if run.status == RunStatus.QUEUED:
            if run.cancel_requested:
                return None
            message = f"Run started on worker {worker}"
        elif run.status == RunStatus.RUNNING and (
            run.heartbeat_at is None or now - run.heartbeat_at > stale_after
        ):
            if run.pause_requested and not run.cancel_requested:
                # It was to pause at its next step anyway: paused where its last step left it,
                # rather than loaded on another worker only to stop.
                run_transition(
                    run_id=run.pk,
                    to=RunStatus.PAUSED,
                    message=f"Worker {run.worker or '?'} stopped sending heartbeats while the run was "
                    f"pausing; paused at checkpoint step {run.current_step}",
                    data={"step": run.current_step, "worker": run.worker},
                    updates={"worker": "", "heartbeat_at": None, "pause_requested": False},
                )
                return None
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
        .exclude(kind__in=CLIENT_KINDS)
        .values_list("id", flat=True)
    )
    for run_id in run_ids:
        _enqueue_run(run_id)
    return run_ids
