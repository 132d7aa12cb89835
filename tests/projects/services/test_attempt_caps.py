"""Claimed work that keeps losing its worker fails with the reason instead of looping: a run
(RUN_MAX_ATTEMPTS) and a queued evaluation (EVALUATION_MAX_ATTEMPTS) may be claimed that many
times; the next takeover of a stale one fails it and records why."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import pytest
from django.utils import timezone

from projects import services
from projects.jobs import evaluations as jobs_evaluations
from projects.jobs import runs as jobs_runs
from projects.jobs import tasks
from projects.jobs.claimed import Job
from projects.models import (
    Evaluation,
    EvaluationEvent,
    EvaluationStatus,
    EventLevel,
    Run,
    RunEvent,
    RunStatus,
)

pytestmark = pytest.mark.django_db


def make_run(setup) -> Run:
    return services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward,
        config={"steps": 3},
    )  # fmt: skip


def make_evaluation(setup) -> Evaluation:
    return services.evaluation_create(
        task_set=setup.task_set, environment=setup.environment, reward=setup.reward, base_model=setup.base
    )


def _go_stale(model, pk: int) -> datetime:
    last_seen = timezone.now() - timedelta(seconds=600)
    model.objects.filter(pk=pk).update(heartbeat_at=last_seen)
    return last_seen


def test_a_run_whose_worker_keeps_dying_fails_after_run_max_attempts(alpha_setup, settings):
    settings.RUN_MAX_ATTEMPTS = 3
    run = make_run(alpha_setup)
    for attempt in (1, 2, 3):
        claimed = services.run_claim(run_id=run.pk, worker=f"w{attempt}", stale_after_s=300)
        assert claimed is not None and claimed.attempts == attempt
        last_seen = _go_stale(Run, run.pk)  # the worker is killed mid-run
    assert services.run_claim(run_id=run.pk, worker="w4", stale_after_s=300) is None
    run.refresh_from_db()
    reason = f"worker lost 3 times; last seen on w3 at {last_seen.isoformat(timespec='seconds')}"
    assert run.status == RunStatus.FAILED and run.error == reason and run.attempts == 3
    assert run.finished_at is not None and run.worker == "w3"
    event = RunEvent.objects.filter(run=run).last()
    assert event.level == EventLevel.ERROR and event.message == f"Run failed: {reason}"
    assert event.data == {"from": RunStatus.RUNNING, "to": RunStatus.FAILED}
    # Later deliveries of the same message are no-ops.
    assert services.run_claim(run_id=run.pk, worker="w5", stale_after_s=300) is None


def test_the_cap_is_a_setting_and_a_live_owner_is_never_failed(alpha_setup, settings):
    settings.RUN_MAX_ATTEMPTS = 1
    run = make_run(alpha_setup)
    assert services.run_claim(run_id=run.pk, worker="w1") is not None
    assert services.run_claim(run_id=run.pk, worker="w2") is None  # heartbeat fresh: not lost
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    _go_stale(Run, run.pk)
    assert services.run_claim(run_id=run.pk, worker="w2", stale_after_s=300) is None
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and run.error.startswith("worker lost 1 times; last seen on w1 at ")


def test_an_evaluation_whose_worker_keeps_dying_fails_after_evaluation_max_attempts(alpha_setup, settings):
    settings.EVALUATION_MAX_ATTEMPTS = 2
    evaluation = make_evaluation(alpha_setup)
    for attempt in (1, 2):
        claimed = services.evaluation_claim(
            evaluation_id=evaluation.pk, worker=f"w{attempt}", stale_after_s=300
        )
        assert claimed is not None and claimed.attempts == attempt
        last_seen = _go_stale(Evaluation, evaluation.pk)
    assert services.evaluation_claim(evaluation_id=evaluation.pk, worker="w3", stale_after_s=300) is None
    evaluation.refresh_from_db()
    reason = f"worker lost 2 times; last seen on w2 at {last_seen.isoformat(timespec='seconds')}"
    assert evaluation.status == EvaluationStatus.FAILED and evaluation.error == reason
    event = EvaluationEvent.objects.filter(evaluation=evaluation).last()
    assert event.level == EventLevel.ERROR
    assert event.message == f"Evaluation failed: {reason}"


# The tasks close stale database connections as a worker would: outside a test transaction.
@pytest.mark.django_db(transaction=True)
def test_requeued_orphans_past_the_cap_are_failed_by_the_task_not_worked_on(
    alpha_setup, settings, monkeypatch
):
    # The beat re-enqueues the orphans; the task's claim fails them, and no work starts.
    settings.RUN_MAX_ATTEMPTS = settings.EVALUATION_MAX_ATTEMPTS = 1
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)
    monkeypatch.setattr(services.evaluations, "_enqueue", lambda evaluation_id: None)
    monkeypatch.setattr(jobs_runs, "TRAINING", _no_work(jobs_runs.TRAINING))
    monkeypatch.setattr(jobs_evaluations, "EVALUATION", _no_work(jobs_evaluations.EVALUATION))
    run, evaluation = make_run(alpha_setup), make_evaluation(alpha_setup)
    services.run_claim(run_id=run.pk, worker="w1")
    services.evaluation_claim(evaluation_id=evaluation.pk, worker="w1")
    _go_stale(Run, run.pk)
    _go_stale(Evaluation, evaluation.pk)
    assert tasks.requeue_orphaned_runs() == [run.pk]
    assert tasks.requeue_orphaned_evaluations() == [evaluation.pk]
    assert tasks.train_run(run.pk) == "skipped"
    assert tasks.evaluate(evaluation.pk) == "skipped"
    run.refresh_from_db()
    evaluation.refresh_from_db()
    assert run.status == RunStatus.FAILED and "worker lost 1 times; last seen on w1" in run.error
    assert evaluation.status == EvaluationStatus.FAILED and "worker lost 1 times" in evaluation.error
    assert tasks.requeue_orphaned_runs() == [] and tasks.requeue_orphaned_evaluations() == []


def _no_work(job: Job) -> Job:
    def work(claimed):
        raise AssertionError("a run past its attempts must not be worked on")

    return dataclasses.replace(job, work=work)
