"""A user's control of a platform run: cancel, pause (at the worker's next step boundary, or at
once while queued), resume (queued again, continuing from the last recorded checkpoint as after a
crash), and the runs a stopped ``manage.py up`` left running (paused for the user to resume)."""

from __future__ import annotations

from django.db import transaction

from projects.errors import Conflict, InvalidTransition
from projects.models import CLIENT_KINDS, Run, RunStatus
from projects.services import runs
from projects.services.runs import TERMINAL_STATUSES, _refuse_client_run, run_event_add, run_transition


def run_cancel(*, run: Run) -> Run:
    """Queued runs are cancelled at once; a running run stops before its next step."""
    if run.kind in CLIENT_KINDS:
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
