"""Evaluations: a queued job's life (create, claim, heartbeat, finish, fail, cancel, requeue) and a
run's own validation evaluations.

Concurrency invariants, as for runs:
- an evaluation changes status only in ``evaluation_transition`` under ``select_for_update``,
  following ``EVALUATION_TRANSITIONS``, and every transition inserts an EvaluationEvent in the same
  transaction;
- a requested evaluation is enqueued with ``transaction.on_commit``; the task's first act is
  ``evaluation_claim``, a conditional transition, so a duplicate delivery is a no-op;
- its worker beats ``heartbeat_at`` while it works; an evaluation whose heartbeat is older than
  ``RUN_HEARTBEAT_TIMEOUT_S`` is re-enqueued (``evaluations_requeue_orphaned``) and the next claim
  restarts it from scratch, deleting whatever samples it had (it has no checkpoint to resume from);
- results and samples are written in one transaction by ``evaluation_finish``, and only while the
  evaluation is still running on this worker: a cancelled evaluation never gets results;
- a run's evaluation at a step is recorded at most once (the (run, step) unique constraint).

Why one module of this length: an evaluation's whole life cycle (the invariants below) and a run's
validation records, which share the transition table and its locks.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from projects.errors import InvalidTransition, ValidationFailed
from projects.models import (
    BaseModel,
    Checkpoint,
    Environment,
    Evaluation,
    EvaluationEvent,
    EvaluationSample,
    EvaluationStatus,
    EventLevel,
    JudgeEndpoint,
    RewardDefinition,
    Run,
    Split,
    TaskSet,
)
from projects.selectors.evaluations import evaluation_results_summary, model_label
from projects.selectors.task_sets import task_set_rows
from projects.services import webhooks
from projects.services._common import error_text, jsonb_safe, worker_lost_reason
from projects.services.runs import run_event_add, run_platform_inputs
from projects.services.transitions import Machine, work_transition
from training.config import TrainConfig

EVALUATION_SPLITS = ("validation", "train", "all")
MAX_SAMPLES_PER_ROW = 16
MAX_SAMPLES = 5000  # rows x samples per row x sides: bounds one job's time and its stored samples
# The settings a request gives ``evaluation_create`` besides its rows, by the names the API's body and
# the dashboard's form use too.
EVALUATION_SETTINGS = (
    "split",
    "pass_threshold",
    "max_rows",
    "samples_per_row",
    "temperature",
    "max_new_tokens",
    "seed",
)
EVALUATION_TERMINAL_STATUSES = (
    EvaluationStatus.SUCCEEDED,
    EvaluationStatus.FAILED,
    EvaluationStatus.CANCELLED,
)

# The whole evaluation state machine. ``running → running`` is a worker taking over an orphaned
# evaluation. A run's own evaluations are created succeeded (``run_evaluation_record``).
EVALUATION_TRANSITIONS: dict[str, set[str]] = {
    EvaluationStatus.QUEUED: {EvaluationStatus.RUNNING, EvaluationStatus.FAILED, EvaluationStatus.CANCELLED},
    EvaluationStatus.RUNNING: {
        EvaluationStatus.RUNNING,
        EvaluationStatus.SUCCEEDED,
        EvaluationStatus.FAILED,
        EvaluationStatus.CANCELLED,
    },
    EvaluationStatus.SUCCEEDED: set(),
    EvaluationStatus.FAILED: set(),
    EvaluationStatus.CANCELLED: set(),
}


def evaluation_event_add(
    *, evaluation: Evaluation, message: str, level: str = EventLevel.INFO, data: dict[str, Any] | None = None
) -> EvaluationEvent:
    return EvaluationEvent.objects.create(
        evaluation=evaluation, message=message, level=level, data=data or {}
    )


EVALUATION_MACHINE: Machine[Evaluation] = Machine(
    Evaluation,
    EVALUATION_TRANSITIONS,
    frozenset(EVALUATION_TERMINAL_STATUSES),
    "evaluation",
    ended_reads_already=True,
)


def evaluation_transition(
    *,
    evaluation_id: int,
    to: str,
    message: str,
    level: str = EventLevel.INFO,
    data: dict[str, Any] | None = None,
    updates: dict[str, Any] | None = None,
) -> Evaluation:
    """Move an evaluation to ``to`` if the state machine allows it (services.transitions), recording
    an event with ``data`` (an evaluation's events carry its results, not the states)."""

    def announce(evaluation: Evaluation, previous: str) -> None:
        evaluation_event_add(evaluation=evaluation, message=message, level=level, data=data)
        webhooks.announce_evaluation(evaluation)

    return work_transition(EVALUATION_MACHINE, pk=evaluation_id, to=to, updates=updates, announce=announce)


def _number(value: Any, field: str, *, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationFailed("must be a finite number", field=field)
    if not low <= value <= high:
        raise ValidationFailed(f"must be between {low:g} and {high:g}", field=field)
    return float(value)


def _integer(value: Any, field: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValidationFailed(f"must be an integer from {low} to {high}", field=field)
    return value


def run_pass_threshold(checkpoint: Checkpoint | None) -> float:
    """The pass threshold the run that made ``checkpoint`` evaluated with (TrainConfig's default
    for a checkpoint without a run, or a base model)."""
    run = checkpoint.run if checkpoint is not None else None
    value = (run.config or {}).get("eval_pass_threshold") if run is not None else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return TrainConfig().eval_pass_threshold
    return float(value)


def evaluation_create(
    *,
    task_set: TaskSet,
    environment: Environment,
    reward: RewardDefinition,
    checkpoint: Checkpoint | None = None,
    base_model: BaseModel | None = None,
    split: str = "validation",
    pass_threshold: float | None = None,
    max_rows: int | None = None,
    samples_per_row: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int | None = None,
    seed: int = 0,
    reference_checkpoint: Checkpoint | None = None,
    reference_base_model: BaseModel | None = None,
    reference_endpoint: JudgeEndpoint | None = None,
    reference_model: str = "",
    created_by: User | None = None,
) -> Evaluation:
    """Queue an evaluation of a checkpoint or a base model on a task set's split, optionally
    against a reference (a checkpoint, a base model, or a model behind a team endpoint).
    ``pass_threshold`` left out: the one the checkpoint's run evaluated with (its
    ``eval_pass_threshold``), else TrainConfig's default, so the CLI's and the API's figure for a
    run's checkpoint is the run page's (the demo passes at 0.5, not 1.0)."""
    project = task_set.project
    for field, obj in (("environment", environment), ("reward", reward)):
        if obj.project_id != project.id:
            raise ValidationFailed("must belong to the same project as the task set", field=field)
    if (checkpoint is None) == (base_model is None):
        raise ValidationFailed("give exactly one of model or checkpoint", field="model")
    if split not in EVALUATION_SPLITS:
        raise ValidationFailed(f"must be one of {', '.join(EVALUATION_SPLITS)}", field="split")
    if pass_threshold is None:
        pass_threshold = run_pass_threshold(checkpoint)
    pass_threshold = _number(pass_threshold, "pass_threshold", low=-1e9, high=1e9)
    if max_rows is not None:
        max_rows = _integer(max_rows, "max_rows", low=1, high=MAX_SAMPLES)
    samples_per_row = _integer(samples_per_row, "samples_per_row", low=1, high=MAX_SAMPLES_PER_ROW)
    temperature = _number(temperature, "temperature", low=0.0, high=2.0)
    if max_new_tokens is None:
        max_new_tokens = int(environment.sampling.get("max_new_tokens", TrainConfig().max_new_tokens))
    max_new_tokens = _integer(max_new_tokens, "max_new_tokens", low=1, high=4096)
    seed = _integer(seed, "seed", low=0, high=2**31 - 1)
    references = [
        r for r in (reference_checkpoint, reference_base_model, reference_endpoint) if r is not None
    ]
    if len(references) > 1:
        raise ValidationFailed("give one of checkpoint, model or endpoint", field="reference")
    if reference_endpoint is not None:
        reference_model = reference_model or reference_endpoint.default_model
        if not reference_model:
            raise ValidationFailed(
                "name the model to call on the endpoint (it has no default model)", field="reference.model"
            )
    else:
        reference_model = ""
    row_count = len(task_set_rows(task_set=task_set, split=split, max_rows=max_rows))
    if row_count == 0:
        raise ValidationFailed(f"the task set has no {split} rows", field="split")
    sides = 2 if references else 1
    if row_count * samples_per_row * sides > MAX_SAMPLES:
        raise ValidationFailed(
            f"{row_count} rows x {samples_per_row} samples x {sides} models is more than {MAX_SAMPLES} samples; "
            "lower max_rows or samples_per_row",
            field="max_rows",
        )
    config = {
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "stop": list(environment.sampling.get("stop", [])),
    }
    with transaction.atomic():
        evaluation = Evaluation.objects.create(
            project=project,
            checkpoint=checkpoint,
            base_model=base_model,
            task_set=task_set,
            split=split,
            environment=environment,
            reward=reward,
            pass_threshold=pass_threshold,
            max_rows=max_rows,
            samples_per_row=samples_per_row,
            config=config,
            reference_checkpoint=reference_checkpoint,
            reference_base_model=reference_base_model,
            reference_endpoint=reference_endpoint,
            reference_model=reference_model,
            created_by=created_by,
        )
        subject = model_label(checkpoint, base_model)
        evaluation_event_add(
            evaluation=evaluation,
            message=f"Evaluation created: {subject} on {row_count} {split} rows of {task_set.name}",
        )
        transaction.on_commit(lambda: _enqueue(evaluation.pk))
    return evaluation


def _enqueue(evaluation_id: int) -> None:
    from projects.jobs.queues import evaluation_queue
    from projects.jobs.tasks import evaluate

    # A work queue: an evaluation loads a model, like a run (projects.jobs.queues).
    evaluate.apply_async(args=(evaluation_id,), queue=evaluation_queue(evaluation_id))


def _stale_after(stale_after_s: float | None) -> timedelta:
    return timedelta(seconds=stale_after_s if stale_after_s is not None else settings.RUN_HEARTBEAT_TIMEOUT_S)


def evaluation_claim(
    *, evaluation_id: int, worker: str, stale_after_s: float | None = None, max_attempts: int | None = None
) -> Evaluation | None:
    """The idempotent first act of the evaluation task: queued → running for this worker.

    A running evaluation whose worker has not beaten its heartbeat for ``stale_after_s`` (default
    ``RUN_HEARTBEAT_TIMEOUT_S``) is taken over and **restarted from scratch**: an evaluation keeps
    no checkpoint of its progress, so the samples it may have stored are deleted in this same
    transaction and every sample ends up recorded exactly once, unless it was claimed ``max_attempts``
    times (``EVALUATION_MAX_ATTEMPTS``): then it fails with the reason. Anything else (a duplicate
    delivery, a live owner, a finished or cancelled evaluation) returns None and changes nothing.
    """
    cap = max_attempts if max_attempts is not None else settings.EVALUATION_MAX_ATTEMPTS
    with transaction.atomic():
        evaluation = Evaluation.objects.select_for_update().filter(pk=evaluation_id).first()
        if evaluation is None:
            return None
        now = timezone.now()
        if evaluation.status == EvaluationStatus.QUEUED:
            message = f"Evaluation started on worker {worker}"
        elif evaluation.status == EvaluationStatus.RUNNING and (
            evaluation.heartbeat_at is None or now - evaluation.heartbeat_at > _stale_after(stale_after_s)
        ):
            if evaluation.attempts >= cap:  # EVALUATION_MAX_ATTEMPTS
                evaluation_fail(evaluation_id=evaluation.pk, error=worker_lost_reason(evaluation))
                return None
            deleted, _ = EvaluationSample.objects.filter(evaluation=evaluation).delete()
            message = (
                f"Worker {evaluation.worker or '?'} stopped sending heartbeats; restarting from scratch on {worker}"
                + (f" ({deleted} partial samples deleted)" if deleted else "")
            )
        else:
            return None
        return evaluation_transition(
            evaluation_id=evaluation.pk,
            to=EvaluationStatus.RUNNING,
            message=message,
            updates={
                "worker": worker,
                "started_at": now,
                "heartbeat_at": now,
                "results": {},
                "attempts": evaluation.attempts + 1,
            },
        )


def evaluation_heartbeat(*, evaluation_id: int, worker: str) -> bool:
    """Refresh the heartbeat; False if this worker no longer owns the evaluation (cancelled or
    taken over): it must stop."""
    updated = Evaluation.objects.filter(
        pk=evaluation_id, worker=worker, status=EvaluationStatus.RUNNING
    ).update(heartbeat_at=timezone.now())
    return updated == 1


def evaluations_requeue_orphaned(*, stale_after_s: float | None = None) -> list[int]:
    """Re-enqueue running evaluations whose worker stopped heartbeating (celery beat, next to
    ``services.runs_requeue_orphaned``); the claim decides who restarts them, from scratch. A
    running evaluation without any heartbeat (started before heartbeats existed) counts as orphaned."""
    cutoff = timezone.now() - _stale_after(stale_after_s)
    evaluation_ids = list(
        Evaluation.objects.filter(status=EvaluationStatus.RUNNING)
        .filter(Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True))
        .values_list("id", flat=True)
    )
    for evaluation_id in evaluation_ids:
        _enqueue(evaluation_id)
    return evaluation_ids


def _samples(evaluation: Evaluation, samples: list[Any]) -> None:
    EvaluationSample.objects.bulk_create(
        [
            EvaluationSample(
                evaluation=evaluation,
                side=sample.side,
                task_row_index=sample.task_row_index,
                sample_index=sample.sample_index,
                messages=jsonb_safe(sample.messages),
                reward=sample.reward,
                sub_rewards=sample.sub_rewards,
                errors=jsonb_safe(sample.errors),
                metrics=jsonb_safe(sample.metrics),
            )
            for sample in samples
        ],
        batch_size=200,
    )


def evaluation_finish(
    *, evaluation_id: int, worker: str, results: dict[str, Any], samples: list[Any]
) -> bool:
    """Store results and samples and mark the evaluation succeeded, in one transaction; False (and
    nothing written) when it was cancelled or taken over meanwhile."""
    with transaction.atomic():
        evaluation = Evaluation.objects.select_for_update().get(pk=evaluation_id)
        if evaluation.status != EvaluationStatus.RUNNING or evaluation.worker != worker:
            return False
        _samples(evaluation, samples)
        stored = jsonb_safe(results)
        evaluation_transition(
            evaluation_id=evaluation.pk,
            to=EvaluationStatus.SUCCEEDED,
            message=f"Evaluation succeeded: {evaluation_results_summary(results)}",
            data=stored,
            updates={"results": stored},
        )
    return True


def evaluation_fail(*, evaluation_id: int, error: str, worker: str | None = None) -> bool:
    """Mark the evaluation failed; False (nothing written) when it already ended or, with
    ``worker``, when another worker has taken it over meanwhile (its failure is not this one's)."""
    message = error_text(error)
    with transaction.atomic():
        evaluation = Evaluation.objects.select_for_update().get(pk=evaluation_id)
        if worker is not None and evaluation.worker != worker:
            return False
        try:
            evaluation_transition(
                evaluation_id=evaluation.pk,
                to=EvaluationStatus.FAILED,
                message=f"Evaluation failed: {message}",
                level=EventLevel.ERROR,
                updates={"error": message},
            )
        except InvalidTransition:
            return False
    return True


def evaluation_cancel(*, evaluation: Evaluation) -> Evaluation:
    """A queued or running evaluation becomes cancelled at once; a running worker notices before
    its next phase and its results are never stored."""
    return evaluation_transition(
        evaluation_id=evaluation.pk, to=EvaluationStatus.CANCELLED, message="Evaluation cancelled"
    )


def _against_baseline(run: Run, step: int, samples: list[Any]) -> dict[str, Any]:
    """The run's first evaluation (its untrained checkpoint) as the reference of a later one: did
    training make it better? Same rows, win rate by reward (``training.runs.evaluation.compare``)."""
    from training.runs.evaluation import EvalSample, compare

    baseline = Evaluation.objects.filter(run=run, step__lt=step).order_by("step").first()
    if baseline is None:
        return {}
    earlier = [
        EvalSample("reference", row, index, [], reward)
        for row, index, reward in baseline.samples.filter(side="subject").values_list(
            "task_row_index", "sample_index", "reward"
        )
    ]
    return {"baseline_step": baseline.step, "comparison_to_baseline": compare(samples, earlier)}


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0
    return max(0.0, min(float(value), 7 * 86400.0))


def run_evaluation_record(*, run: Run, step: int, results: dict[str, Any], samples: list[Any]) -> Evaluation:
    """Record a run's validation evaluation of its checkpoint ``step`` (idempotent per step: a
    resumed run that evaluates a step again keeps the first record)."""
    config = TrainConfig.from_dict(run.config)
    task_set, environment, reward = run_platform_inputs(run=run)
    with transaction.atomic():
        existing = Evaluation.objects.filter(run=run, step=step).first()
        if existing is not None:
            return existing
        results = {**results, **_against_baseline(run, step, samples)}
        now = timezone.now()
        # The results carry how long it ran (training.runs.evaluation): it started that long ago.
        started = now - timedelta(seconds=_seconds(results.get("seconds")))
        evaluation = Evaluation.objects.create(
            project=run.project,
            run=run,
            step=step,
            checkpoint=Checkpoint.objects.filter(model=run.model, step=step).first(),
            task_set=task_set,
            split=Split.VALIDATION,
            environment=environment,
            reward=reward,
            pass_threshold=config.eval_pass_threshold,
            max_rows=config.eval_max_rows,
            samples_per_row=config.eval_samples_per_row,
            config={
                "temperature": config.eval_temperature,
                "max_new_tokens": config.max_new_tokens,
                "seed": config.seed,
            },
            status=EvaluationStatus.SUCCEEDED,
            results=jsonb_safe(results),
            started_at=started,
            finished_at=now,
        )
        # Recorded when it ended, it was asked for when it started: created_at is auto_now_add, so
        # set after the insert (a run's evaluation showed "created" after it "started").
        evaluation.created_at = started
        Evaluation.objects.filter(pk=evaluation.pk).update(created_at=started)
        _samples(evaluation, samples)
        evaluation_event_add(
            evaluation=evaluation, message=f"Step {step} evaluated: {evaluation_results_summary(results)}"
        )
        # A message, not a metrics event: clients read metrics events as training steps.
        run_event_add(
            run=run,
            message=f"Evaluation at step {step}: {evaluation_results_summary(results)}",
            data={
                "step": step,
                "evaluation": evaluation.pk,
                **{k: v for k, v in evaluation.results.items() if not isinstance(v, dict)},
            },
        )
    return evaluation
