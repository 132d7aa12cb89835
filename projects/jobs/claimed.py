"""Claimed work: the frame that a training run and a queued evaluation share.

A job is delivered at least once. Its first act is an idempotent claim: a duplicate delivery, a
finished row or a row owned by a live worker is a no-op ("skipped"). While the work runs a
heartbeat thread keeps the claim; a worker that dies stops beating, and the beat task re-enqueues
the row for the next claim (a run resumes from its last checkpoint, an evaluation restarts).
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from django.conf import settings
from django.db import close_old_connections, connection

from projects import metrics
from projects.logs import log_context

logger = logging.getLogger(__name__)

Row = TypeVar("Row")


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Heartbeat(threading.Thread):
    """Beats while long work runs (a training step, an evaluation's rollouts) in the task's thread.

    ``beat`` refreshes the owner's heartbeat row (``services.run_heartbeat``,
    ``services.evaluation_heartbeat``) and returns False once this worker no longer owns it
    (taken over, or an evaluation cancelled): ``lost`` then tells the work to stop. Use it as a
    context manager: it beats every ``interval`` seconds from entry to exit.
    """

    def __init__(self, beat: Callable[[], bool], *, name: str, interval: float) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{name}")
        self.beat, self.interval = beat, interval
        self.stopped = threading.Event()
        self.lost = False
        self._log_context = contextvars.copy_context()  # its log lines name the row too (projects.logs)

    @classmethod
    def every_quarter_timeout(cls, beat: Callable[[], bool], *, name: str) -> Heartbeat:
        """Four beats per ``RUN_HEARTBEAT_TIMEOUT_S``: one slow beat does not make the owner stale."""
        return cls(beat, name=name, interval=max(0.2, settings.RUN_HEARTBEAT_TIMEOUT_S / 4))

    def run(self) -> None:
        self._log_context.run(self._beat_until_stopped)

    def _beat_until_stopped(self) -> None:
        try:
            while not self.stopped.wait(self.interval):
                try:
                    if not self.beat():
                        self.lost = True
                except Exception:  # a DB blip must not kill the work; the next beat retries
                    logger.exception("heartbeat %s failed", self.name)
        finally:
            connection.close()

    def __enter__(self) -> Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self.join(timeout=5)


def readable(exc: BaseException) -> str:
    """One line a user can act on, plus where it happened (the full traceback is in the worker log)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


@dataclass(frozen=True)
class Claimed(Generic[Row]):
    """What the work gets: the claimed row, this worker's id and the heartbeat keeping the claim."""

    row: Row
    worker: str
    heartbeat: Heartbeat


@dataclass(frozen=True)
class Job(Generic[Row]):
    """One kind of claimed work, as plain functions of the row's id and this worker's id."""

    kind: str  # "run", "evaluation": names the heartbeat thread and the log lines
    claim: Callable[[int, str], Row | None]  # the row, now this worker's; None when not to be worked on
    beat: Callable[[int, str], bool]  # refresh the heartbeat; False once this worker lost the row
    work: Callable[[Claimed[Row]], str]  # the work itself; returns the outcome ("succeeded", ...)
    fail: Callable[[int, str, BaseException], None]  # record a failure of the work (id, worker, error)
    # After the heartbeat stopped: record the outcome (a run's final transition). Its errors are
    # not failures of the work and propagate.
    finish: Callable[[Row, str], None] | None = None
    # The user's errors (a grader failing on too many samples): recorded, not logged with a traceback.
    expected_errors: tuple[type[Exception], ...] = ()


def work_on(job: Job[Row], row_id: int) -> str:
    """Claim ``row_id`` for this worker and do ``job`` under a heartbeat. Any failure of the work
    is recorded through ``job.fail`` ("failed"), never a crash of the worker."""
    with log_context(**{f"{job.kind.replace('-', '_')}_id": row_id}):  # every log line names the row
        outcome = _work_on(job, row_id)
    metrics.JOBS_FINISHED.labels(job.kind, outcome).inc()
    return outcome


def _work_on(job: Job[Row], row_id: int) -> str:
    close_old_connections()
    worker = worker_id()
    row = job.claim(row_id, worker)
    if row is None:
        return "skipped"
    if settings.TORCH_THREADS:
        import torch

        torch.set_num_threads(settings.TORCH_THREADS)
    heartbeat = Heartbeat.every_quarter_timeout(lambda: job.beat(row_id, worker), name=f"{job.kind}-{row_id}")
    try:
        with heartbeat:
            outcome = job.work(Claimed(row=row, worker=worker, heartbeat=heartbeat))
    except Exception as exc:
        if not isinstance(exc, job.expected_errors):
            logger.exception("%s %s failed", job.kind, row_id)
        job.fail(row_id, worker, exc)
        return "failed"
    if job.finish is not None:
        job.finish(row, outcome)
    return outcome
