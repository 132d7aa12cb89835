"""A user's control of a platform run: cancel, pause (at the worker's next step boundary, or at
once while queued), resume (queued again, continuing from the last recorded checkpoint as after a
crash), and the runs a stopped ``manage.py up`` left running (paused for the user to resume).

A client run (ART's training jobs, a Tinker training client) has no worker to stop: it ends when a
user stops it, when its client closes it (``tinker_session_finish``) or when its client has been
idle for ``CLIENT_RUN_IDLE_S`` (``client_runs_close_idle``, a beat task)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from projects.errors import InvalidTransition
from projects.models import (
    CLIENT_KINDS,
    Run,
    RunKind,
    RunStatus,
    TinkerFuture,
    TinkerFutureStatus,
    TinkerSession,
    TrainableModel,
    TrainingJob,
    TrainingJobStatus,
)
from projects.services import runs
from projects.services.runs import TERMINAL_STATUSES, _refuse_client_run, run_event_add, run_transition


def run_cancel(*, run: Run) -> Run:
    """Queued runs are cancelled at once; a running run stops before its next step. A client run
    (ART, Tinker) is stopped at once: ``client_run_end``."""
    if run.kind in CLIENT_KINDS:
        ended = client_run_end(
            run_id=run.pk,
            to=RunStatus.CANCELLED,
            message="Run stopped by a user: its client's further training requests are refused "
            + _CLIENT_AFTER[RunKind(run.kind)],
        )
        if ended is None:
            raise InvalidTransition(f"the run already {Run.objects.get(pk=run.pk).status}", field="status")
        return ended
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


def run_pause(*, run: Run) -> Run:
    """A running run pauses before its next step (its worker finishes the step, records it, then
    gives the run up); a queued one is paused at once. Resume with ``run_resume``."""
    _refuse_client_run(run, "pause")
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status not in (RunStatus.QUEUED, RunStatus.RUNNING):
            raise InvalidTransition(f"a {locked.status} run cannot be paused", field="status")
        if locked.cancel_requested:
            raise InvalidTransition("the run is being cancelled", field="status")
        if locked.status == RunStatus.QUEUED:
            # Its message may still be in the queue: the claim skips a paused run.
            return run_transition(
                run_id=locked.pk,
                to=RunStatus.PAUSED,
                message="Run paused before a worker took it; resume queues it again",
            )
        if not locked.pause_requested:
            locked.pause_requested = True
            locked.save(update_fields=["pause_requested"])
            run_event_add(run=locked, message="Pause requested; the run pauses after its current step")
        return locked


def run_pause_finish(*, run_id: int, worker: str) -> Run | None:
    """The worker's side of a pause, after its loop stopped at a step boundary: the run becomes
    ``paused`` and the claim is given up (no worker, no heartbeat). A cancellation that arrived
    meanwhile wins. None if this worker no longer owns the run."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run_id)
        if locked.status != RunStatus.RUNNING or locked.worker != worker:
            return None
        if locked.cancel_requested:
            return run_transition(run_id=run_id, to=RunStatus.CANCELLED, message="Run cancelled")
        return run_transition(
            run_id=run_id,
            to=RunStatus.PAUSED,
            message=f"Run paused at checkpoint step {locked.current_step}; resume continues from it",
            data={"step": locked.current_step, "worker": worker},
            updates={"worker": "", "heartbeat_at": None, "pause_requested": False},
        )


def runs_pause_interrupted() -> list[int]:
    """Pause the platform runs left ``running`` by a stack that stopped (``manage.py up`` on its own
    database, where no other worker can be alive): they wait for the user's resume, from their last
    recorded checkpoint, instead of being taken up unannounced once a worker is free."""
    paused = []
    for run_id in (
        Run.objects.filter(status=RunStatus.RUNNING)
        .exclude(kind__in=CLIENT_KINDS)
        .values_list("id", flat=True)
    ):
        with transaction.atomic():
            locked = Run.objects.select_for_update().get(pk=run_id)
            if locked.status != RunStatus.RUNNING:
                continue
            run_transition(
                run_id=run_id,
                to=RunStatus.PAUSED,
                message=f"The platform stopped while this run was running; paused at checkpoint step "
                f"{locked.current_step}. Resume it (dashboard, or POST /api/v1/runs/{run_id}/resume/) to "
                "continue from there",
                data={"step": locked.current_step, "worker": locked.worker},
                updates={"worker": "", "heartbeat_at": None, "pause_requested": False},
            )
            paused.append(run_id)
    return paused


def run_resume(*, run: Run) -> Run:
    """A paused run is queued again; the worker that claims it continues from the last recorded
    checkpoint exactly as after a crash. Its claim count starts over: a pause is not a lost worker
    (``RUN_MAX_ATTEMPTS``)."""
    _refuse_client_run(run, "resume")
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status != RunStatus.PAUSED:
            raise InvalidTransition(
                f"only a paused run can be resumed; this one is {locked.status}", field="status"
            )
        resumed = run_transition(
            run_id=locked.pk,
            to=RunStatus.QUEUED,
            message=f"Run resumed: queued to continue from checkpoint step {locked.current_step}",
            data={"step": locked.current_step, "attempts_before": locked.attempts},
            updates={"attempts": 0, "pause_requested": False},
        )
        runs._enqueue_run(resumed.pk)  # through the module: tests capture it there
    return resumed


# What a client does after its run ended, by kind.
_CLIENT_AFTER = {
    RunKind.CLIENT: "(its training jobs not yet done failed; the next one starts a new client run from "
    "the model's latest checkpoint)",
    RunKind.TINKER: "(create a training client from its last saved checkpoint to go on)",
}


def client_run_end(
    *,
    run_id: int,
    to: str,
    message: str,
    idle_before: datetime | None = None,
    updates: dict[str, Any] | None = None,
) -> Run | None:
    """End a running client run through the run state machine; an ART run's unfinished training
    jobs fail with it. The model's row is locked first, as ``training_job_create`` locks it, so no
    job joins the run while it ends. ``idle_before``: only if its client has shown nothing since
    then (``client_run_last_seen``, read under the locks). None when the run was not ended."""
    from projects.services.training_jobs import training_job_fail

    with transaction.atomic():
        model_id = Run.objects.filter(pk=run_id).values_list("model_id", flat=True).get()
        TrainableModel.objects.select_for_update().get(pk=model_id)
        run = Run.objects.select_for_update().get(pk=run_id)
        if run.status != RunStatus.RUNNING:
            return None
        if idle_before is not None:
            seen = client_run_last_seen(run)
            if seen is None or seen > idle_before:
                return None
        ended = run_transition(run_id=run_id, to=to, message=message, updates=updates)
        for job_id in TrainingJob.objects.filter(run_id=run_id, status__in=_UNFINISHED_JOBS).values_list(
            "id", flat=True
        ):
            training_job_fail(job_id=job_id, error=f"its client run #{run_id} ended: {message}")
    return ended


_UNFINISHED_JOBS = (TrainingJobStatus.QUEUED, TrainingJobStatus.RUNNING)


def client_run_last_seen(run: Run) -> datetime | None:
    """When the client last showed it is there: its run's last step (or start), its last training
    job and, for a Tinker client, its session's last heartbeat; None while it has work pending."""
    times = [run.heartbeat_at, run.started_at, run.created_at]
    if run.kind == RunKind.TINKER:
        if TinkerFuture.objects.filter(model__run=run, status=TinkerFutureStatus.PENDING).exists():
            return None
        times.append(
            TinkerSession.objects.filter(models__run=run).aggregate(last=Max("heartbeat_at"))["last"]
        )
    else:
        if TrainingJob.objects.filter(run=run, status__in=_UNFINISHED_JOBS).exists():
            return None
        times.append(TrainingJob.objects.filter(run=run).aggregate(last=Max("finished_at"))["last"])
    return max(t for t in times if t is not None)


def client_runs_close_idle(*, idle_s: float | None = None) -> list[int]:
    """End the client runs whose client is gone: running, nothing pending, and no step, training
    job or (Tinker) session heartbeat for ``idle_s`` (default ``CLIENT_RUN_IDLE_S``). They succeed:
    a client that is done simply stops (ART never says so; many Tinker scripts close no session).
    The ids ended."""
    idle = settings.CLIENT_RUN_IDLE_S if idle_s is None else idle_s
    cutoff = timezone.now() - timedelta(seconds=idle)
    closed = []
    for run in Run.objects.filter(status=RunStatus.RUNNING, kind__in=CLIENT_KINDS).order_by("id"):
        ended = client_run_end(
            run_id=run.pk,
            to=RunStatus.SUCCEEDED,
            message=f"Run ended: its client has been idle for over {idle:.0f} s (CLIENT_RUN_IDLE_S) "
            + _CLIENT_AFTER[RunKind(run.kind)],
            idle_before=cutoff,
        )
        if ended is not None:
            closed.append(run.pk)
    return closed
