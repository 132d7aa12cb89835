"""The Celery tasks, and nothing else: each claims its row and makes one call.

The ``name=`` strings are stable (they predate this module: messages already queued must still
route). ``train_run`` and ``evaluate`` are delivered at least once and claim idempotently
(``projects.jobs.claimed``); the beat tasks re-enqueue rows whose worker stopped heartbeating.
"""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from projects import services
from projects.jobs import claimed, queues, runs, tinker, training_jobs
from projects.jobs import completions as completion_jobs
from projects.jobs import evaluations as evaluation_jobs
from projects.jobs import exports as export_jobs


@shared_task(name="training.train_run", acks_late=True, time_limit=settings.RUN_TIME_LIMIT_S)
def train_run(run_id: int) -> str:
    """Train a run from its start (or resume it from its last checkpoint) to its last step."""
    return claimed.work_on(runs.TRAINING, run_id)


@shared_task(
    name="training.evaluate",
    acks_late=True,
    # Past the soft limit the evaluation fails readably; the hard limit is the backstop.
    soft_time_limit=settings.EVALUATION_TIME_LIMIT_S,
    time_limit=settings.EVALUATION_TIME_LIMIT_S + 60,
)
def evaluate(evaluation_id: int) -> str:
    """Evaluate a checkpoint or base model (and a reference) on a task set's rows."""
    return claimed.work_on(evaluation_jobs.EVALUATION, evaluation_id)


@shared_task(name="training.train_job", acks_late=True, time_limit=settings.TRAINING_JOB_TIME_LIMIT_S)
def train_job(job_id: int) -> str:
    """One step of a client's training job (/v1/preview/training-jobs): checkpoint N to N+1."""
    return claimed.work_on(training_jobs.TRAINING_JOB, job_id)


@shared_task(name="tinker.drain", acks_late=True, time_limit=settings.TRAINING_JOB_TIME_LIMIT_S)
def tinker_drain(model_id: str) -> int:
    """Run a Tinker training client's queued requests in seq_id order (projects.jobs.tinker)."""
    return tinker.drain(model_id)


@shared_task(name="tinker.sample", acks_late=True, time_limit=settings.TRAINING_JOB_TIME_LIMIT_S)
def tinker_sample(future_id: str) -> None:
    tinker.sample(future_id)


@shared_task(name="training.export_checkpoint", acks_late=True, time_limit=3600)
def export_checkpoint(export_id: int) -> str:
    """Merge a checkpoint's adapter into its base model's weights and store the folder."""
    return claimed.work_on(export_jobs.EXPORT, export_id)


@shared_task(name="training.requeue_orphaned_exports", time_limit=60)
def requeue_orphaned_exports() -> list[int]:
    """Exports whose worker stopped heartbeating (or whose message was lost) go back on the queue."""
    return services.exports_requeue_orphaned()


@shared_task(name="training.expire_tinker_names", time_limit=300)
def expire_tinker_names() -> int:
    """Tinker checkpoint names past their TTL are dropped (their checkpoints deleted if unused)."""
    return services.tinker_names_expire()


@shared_task(name="training.expire_stored_completions", time_limit=600)
def expire_stored_completions() -> int:
    """Stored completions past their team's retention are deleted (hourly)."""
    return services.stored_completions_expire()


@shared_task(name="training.grade_stored_completions", time_limit=3600)
def grade_stored_completions(grading_id: int) -> str:
    """A reward definition over stored completions (projects.jobs.completions)."""
    return completion_jobs.grade(grading_id)


@shared_task(name="training.requeue_orphaned_runs", time_limit=60)
def requeue_orphaned_runs() -> list[int]:
    """Running runs whose worker stopped heartbeating go back on the queue; they resume."""
    return services.runs_requeue_orphaned()


@shared_task(name="training.close_idle_client_runs", time_limit=60)
def close_idle_client_runs() -> list[int]:
    """Client runs (ART, Tinker) whose client has been idle for CLIENT_RUN_IDLE_S end."""
    return services.client_runs_close_idle()


@shared_task(name="training.requeue_orphaned_evaluations", time_limit=60)
def requeue_orphaned_evaluations() -> list[int]:
    """Evaluation jobs whose worker stopped heartbeating go back on the queue; they restart from scratch."""
    return services.evaluations_requeue_orphaned()


@shared_task(name="training.requeue_orphaned_training_jobs", time_limit=60)
def requeue_orphaned_training_jobs() -> list[int]:
    """Training jobs whose worker stopped heartbeating (or whose message was lost) go back on the queue."""
    return services.training_jobs_requeue_orphaned()


@shared_task(name="training.warn_unserved_queues", time_limit=60)
def warn_unserved_queues() -> list[str]:
    """Work queued too long on a queue no live worker consumes gets a warning event naming it."""
    return queues.warn_unserved_queues()


@shared_task(name="webhooks.deliver", bind=True, time_limit=120, max_retries=None)
def deliver_webhook(self, delivery_id: int) -> str:  # type: ignore[no-untyped-def]
    """POST one webhook delivery; after a failure, again with exponential backoff up to
    WEBHOOK_MAX_ATTEMPTS (the delivery row counts attempts, so a redelivered message is a no-op)."""
    from projects.services import webhooks

    attempt = webhooks.webhook_attempt(delivery_id=delivery_id)
    if attempt.retry_in_s is not None:
        raise self.retry(countdown=attempt.retry_in_s)
    return "delivered" if attempt.delivered else "failed"


@shared_task(name="scenarios.generate", time_limit=300)
def generate_scenarios(job_id: int) -> str:
    """Generate a task set for the dashboard (a ScenarioJob): bounded by the service's own deadline
    (GENERATION_DEADLINE_S, 120 s) well inside the time limit; a duplicate delivery is a no-op."""
    from projects.services import scenarios

    return scenarios.scenario_job_run(job_id=job_id, worker=generate_scenarios.request.hostname or "")
