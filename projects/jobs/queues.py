"""Which work queue a run, evaluation or training job goes to, and the check that says so when no
worker listens there.

Routing: the base model's ``queue`` (the operator's, ``registerbasemodel --queue``), else
``settings.WORK_QUEUE_DEFAULT`` (projects.queues). It is looked up when the message is sent (after
commit), so a re-queued run follows an operator's later change of its base model's queue.

The check (beat task ``training.warn_unserved_queues``): work still queued after
``QUEUE_NO_WORKER_TIMEOUT_S`` on a queue that no live worker answers for in a control ping gets one
warning event, ``data.queue_unserved = <queue>``; once per item. A client's training job fails
with that reason (``training_failed``: the client polling it stops with the message). A ping that fails (a broker without
broadcast, say) warns nobody: "unknown" is not "no worker".
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from projects.models import (
    CLIENT_KINDS,
    BaseModel,
    Evaluation,
    EvaluationStatus,
    EventLevel,
    Run,
    RunStatus,
    TrainingJob,
    TrainingJobStatus,
)

logger = logging.getLogger(__name__)

UNSERVED_KEY = "queue_unserved"  # the warning event's data key (its value: the queue's name)


def base_model_queue(base_model: BaseModel | None) -> str:
    return (base_model.queue if base_model is not None else "") or settings.WORK_QUEUE_DEFAULT


def run_queue(run_id: int) -> str:
    run = Run.objects.filter(pk=run_id).select_related("model__base_model").first()
    return base_model_queue(run.model.base_model if run else None)


def training_job_queue(job_id: int) -> str:
    job = TrainingJob.objects.filter(pk=job_id).select_related("model__base_model").first()
    return base_model_queue(job.model.base_model if job else None)


def _evaluation_base_model(evaluation: Evaluation) -> BaseModel | None:
    if evaluation.checkpoint is not None:
        return evaluation.checkpoint.model.base_model
    if evaluation.base_model is not None:
        return evaluation.base_model
    return evaluation.run.model.base_model if evaluation.run is not None else None


def evaluation_queue(evaluation_id: int) -> str:
    evaluation = (
        Evaluation.objects.filter(pk=evaluation_id)
        .select_related("checkpoint__model__base_model", "base_model", "run__model__base_model")
        .first()
    )
    return base_model_queue(_evaluation_base_model(evaluation) if evaluation else None)


def listening_queues(*, timeout_s: float) -> set[str] | None:
    """The queues some live worker consumes from (a broadcast ``active_queues`` control command),
    or None when the broker gave no answer we can trust (an error, not an empty reply)."""
    # The project's Celery app: current in the thread that imported its package (artweb/__init__.py,
    # with the settings), and in every thread of a worker (Celery makes it the default there).
    from celery import current_app

    try:
        replies = current_app.control.inspect(timeout=timeout_s).active_queues()
    except Exception:  # noqa: BLE001 - the broker's failure modes vary by transport
        logger.warning("could not ask the workers which queues they consume", exc_info=True)
        return None
    return {queue["name"] for queues in (replies or {}).values() for queue in queues or []}


def warn_unserved_queues(*, timeout_s: float | None = None) -> list[str]:
    """Add the "no worker is listening on queue X" warning to every run, evaluation and client
    training job queued for longer than ``timeout_s`` on a queue no worker consumes; returns the
    unserved queues (empty when all are served, nothing has waited long enough, or the ping failed)."""
    from projects import services  # services import the jobs' enqueue helpers: no cycle at import

    timeout = settings.QUEUE_NO_WORKER_TIMEOUT_S if timeout_s is None else timeout_s
    cutoff = timezone.now() - timedelta(seconds=timeout)
    runs = list(
        Run.objects.filter(status=RunStatus.QUEUED, created_at__lt=cutoff)
        .exclude(kind__in=CLIENT_KINDS)
        .exclude(events__data__has_key=UNSERVED_KEY)
        .select_related("model__base_model")
    )
    evaluations = list(
        Evaluation.objects.filter(status=EvaluationStatus.QUEUED, created_at__lt=cutoff)
        .exclude(events__data__has_key=UNSERVED_KEY)
        .select_related("checkpoint__model__base_model", "base_model", "run__model__base_model")
    )
    jobs = list(
        TrainingJob.objects.filter(status=TrainingJobStatus.QUEUED, created_at__lt=cutoff)
        .select_related("model__base_model", "run")
        .order_by("id")
    )
    waiting = {base_model_queue(run.model.base_model) for run in runs}
    waiting |= {base_model_queue(_evaluation_base_model(evaluation)) for evaluation in evaluations}
    waiting |= {base_model_queue(job.model.base_model) for job in jobs}
    if not waiting:
        return []
    listening = listening_queues(timeout_s=settings.QUEUE_PING_TIMEOUT_S)
    if listening is None:
        return []
    unserved = waiting - listening

    def message(queue: str, what: str) -> str:
        return (
            f"No worker is listening on queue {queue!r}: this {what} has waited over {timeout:.0f} s. "
            f"Start one with: celery -A artweb worker -Q {queue}"
        )

    for run in runs:
        if (queue := base_model_queue(run.model.base_model)) in unserved:
            services.run_event_add(
                run=run, message=message(queue, "run"), level=EventLevel.WARN, data={UNSERVED_KEY: queue}
            )
    for evaluation in evaluations:
        if (queue := base_model_queue(_evaluation_base_model(evaluation))) in unserved:
            services.evaluation_event_add(
                evaluation=evaluation,
                message=message(queue, "evaluation"),
                level=EventLevel.WARN,
                data={UNSERVED_KEY: queue},
            )
    # A client polls its job and would wait forever (ART shows no dashboard): the job fails with
    # the reason, its client sees training_failed, and the client run keeps the warning.
    for job in jobs:
        if (queue := base_model_queue(job.model.base_model)) in unserved:
            services.run_event_add(
                run=job.run,
                message=message(queue, "training job"),
                level=EventLevel.WARN,
                data={UNSERVED_KEY: queue, "training_job": job.pk},
            )
            services.training_job_fail(job_id=job.pk, error=message(queue, "training job"))
    return sorted(unserved)
