"""Work queues per GPU class: runs, evaluations and client training jobs go to their base model's
queue (the operator's, else WORK_QUEUE_DEFAULT); a bad queue name is refused at registration; work
left queued on a queue no live worker consumes gets one warning event naming the queue.

No worker runs here: the message send (``apply_async``) and the workers' answer to the control
ping (``app.control.inspect``) are the boundaries faked."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from artweb.celery import app
from projects import services
from projects.errors import ValidationFailed
from projects.jobs import queues
from projects.jobs.tasks import evaluate, train_job, train_run
from projects.models import BaseModel, Evaluation, Run, RunEvent, TrainingJob
from tests import factories
from training.base_models import BUNDLED_MODEL

pytestmark = pytest.mark.django_db


@pytest.fixture
def gpu_large():
    return factories.BaseModelFactory(name="big-llm", source="/nonexistent/big", queue="gpu-large")


def _run_on(base_model: BaseModel) -> Run:
    return factories.RunFactory(model=factories.TrainableModelFactory(base_model=base_model))


def _workers_listening(*queue_names: str):
    """What ``inspect().active_queues()`` answers: one worker consuming ``queue_names``."""
    inspector = mock.Mock()
    inspector.active_queues.return_value = {"w1@host": [{"name": name} for name in queue_names]}
    return mock.patch.object(app.control, "inspect", return_value=inspector)


def _age(item, seconds: float) -> None:
    type(item).objects.filter(pk=item.pk).update(created_at=timezone.now() - timedelta(seconds=seconds))


def _unserved_events(run: Run) -> list[RunEvent]:
    return list(RunEvent.objects.filter(run=run, data__has_key=queues.UNSERVED_KEY))


# --- routing ------------------------------------------------------------------------------------


def test_run_is_sent_to_its_base_model_queue(gpu_large, django_capture_on_commit_callbacks):
    with (
        mock.patch.object(train_run, "apply_async") as send,
        django_capture_on_commit_callbacks(execute=True),
    ):
        run = _run_on(gpu_large)
    send.assert_called_once_with(args=(run.pk,), queue="gpu-large")


def test_run_without_an_operator_queue_goes_to_the_settings_default(
    settings, django_capture_on_commit_callbacks
):
    settings.WORK_QUEUE_DEFAULT = "cpu"
    with (
        mock.patch.object(train_run, "apply_async") as send,
        django_capture_on_commit_callbacks(execute=True),
    ):
        run = _run_on(factories.BaseModelFactory())
    send.assert_called_once_with(args=(run.pk,), queue="cpu")


def test_requeued_orphan_follows_a_changed_base_model_queue(gpu_large, django_capture_on_commit_callbacks):
    run = _run_on(gpu_large)
    Run.objects.filter(pk=run.pk).update(status="running", heartbeat_at=timezone.now() - timedelta(hours=1))
    services.base_model_register(name=gpu_large.name, source=gpu_large.source, queue="gpu-small")
    with (
        mock.patch.object(train_run, "apply_async") as send,
        django_capture_on_commit_callbacks(execute=True),
    ):
        assert services.runs_requeue_orphaned(stale_after_s=60) == [run.pk]
    send.assert_called_once_with(args=(run.pk,), queue="gpu-small")


def test_an_explicit_queue_beats_the_task_routes_table():
    """Celery's router: the queue given at send time wins over CELERY_TASK_ROUTES (train)."""
    routed = app.amqp.router.route({"queue": "gpu-large"}, train_run.name)
    assert routed["queue"].name == "gpu-large"
    assert app.amqp.router.route({}, train_run.name)["queue"].name == "train"


def test_evaluation_is_sent_to_its_base_model_queue(gpu_large, django_capture_on_commit_callbacks):
    run = _run_on(gpu_large)
    checkpoint = factories.CheckpointFactory(model=run.model, step=0)
    with (
        mock.patch.object(evaluate, "apply_async") as send,
        django_capture_on_commit_callbacks(execute=True),
    ):
        evaluation = services.evaluation_create(
            task_set=run.task_set, environment=run.environment, reward=run.reward, checkpoint=checkpoint
        )
    send.assert_called_once_with(args=(evaluation.pk,), queue="gpu-large")
    base_only = Evaluation.objects.filter(pk=evaluation.pk)
    base_only.update(checkpoint=None, base_model=factories.BaseModelFactory(queue="cpu"))
    assert queues.evaluation_queue(evaluation.pk) == "cpu"


def _client_job(team, base_model: BaseModel) -> TrainingJob:
    model, client_run = services.client_model_register(
        team=team, entity=None, project="math", name="agent", base_model=base_model.name
    )
    # The row as training_job_create leaves it (its upload checks are tested with the preview API).
    return TrainingJob.objects.create(model=model, run=client_run, groups=[], config={})


def test_client_training_job_is_sent_to_its_base_model_queue(
    cast, gpu_large, django_capture_on_commit_callbacks
):
    from projects.services.training_jobs import _enqueue

    job = _client_job(cast.alpha, gpu_large)
    with (
        mock.patch.object(train_job, "apply_async") as send,
        django_capture_on_commit_callbacks(execute=True),
    ):
        _enqueue(job.pk)
    send.assert_called_once_with(args=(job.pk,), queue="gpu-large")


# --- registration ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["GPU Large", "gpu/large", "-gpu", "x" * 64, "default"])
def test_bad_queue_name_at_registration_is_a_clear_error(bad):
    with pytest.raises(CommandError, match="--queue") as raised:
        call_command("registerbasemodel", "m", BUNDLED_MODEL, "--queue", bad)
    assert ("housekeeping" in str(raised.value)) == (bad == "default")
    assert not BaseModel.objects.filter(name="m").exists()
    with pytest.raises(ValidationFailed) as refused:
        services.base_model_register(name="m", source=BUNDLED_MODEL, queue=bad)
    assert refused.value.field == "queue"


def test_registration_sets_the_queue_and_a_later_one_without_queue_keeps_it(capsys):
    call_command("registerbasemodel", "m", BUNDLED_MODEL, "--queue", "gpu-small")
    assert "queue gpu-small" in capsys.readouterr().out
    call_command("registerbasemodel", "m", BUNDLED_MODEL, "--description", "again")
    model = BaseModel.objects.get(name="m")
    assert (model.queue, model.description) == ("gpu-small", "again")
    call_command("registerbasemodel", "m", BUNDLED_MODEL, "--queue", "")
    assert BaseModel.objects.get(name="m").queue == ""


# --- no live worker on the queue --------------------------------------------------------------


def test_run_waiting_on_a_queue_nobody_consumes_gets_one_warning(gpu_large, settings):
    settings.QUEUE_NO_WORKER_TIMEOUT_S = 60
    stuck = _run_on(gpu_large)
    served = _run_on(factories.BaseModelFactory())  # the default queue, "train"
    _age(stuck, 120)
    _age(served, 120)
    with _workers_listening("train", "default") as inspect:
        assert queues.warn_unserved_queues() == ["gpu-large"]
        assert queues.warn_unserved_queues() == []  # warned once, not every beat
    inspect.assert_called_with(timeout=settings.QUEUE_PING_TIMEOUT_S)
    (event,) = _unserved_events(stuck)
    assert event.level == "warn" and event.data == {"queue_unserved": "gpu-large"}
    assert "no worker is listening on queue 'gpu-large'" in event.message.lower()
    assert _unserved_events(served) == []


def test_no_warning_before_the_timeout_or_when_a_worker_listens(gpu_large, settings):
    settings.QUEUE_NO_WORKER_TIMEOUT_S = 600
    young = _run_on(gpu_large)
    _age(young, 30)
    with _workers_listening("train") as inspect:
        assert queues.warn_unserved_queues() == []
    inspect.assert_not_called()  # nothing waited long enough: no ping at all
    _age(young, 3600)
    with _workers_listening("gpu-large", "train"):
        assert queues.warn_unserved_queues() == []
    assert _unserved_events(young) == []


def test_a_failed_ping_warns_nobody(gpu_large, settings):
    settings.QUEUE_NO_WORKER_TIMEOUT_S = 60
    run = _run_on(gpu_large)
    _age(run, 120)
    with mock.patch.object(app.control, "inspect", side_effect=ConnectionError("broker down")):
        assert queues.warn_unserved_queues() == []
    with mock.patch.object(app.control, "inspect") as inspect:
        inspect.return_value.active_queues.return_value = None  # no worker answered at all
        assert queues.warn_unserved_queues() == ["gpu-large"]
    assert len(_unserved_events(run)) == 1


def test_a_client_training_job_no_worker_takes_fails_with_the_reason(cast, gpu_large, settings):
    settings.QUEUE_NO_WORKER_TIMEOUT_S = 60
    job = _client_job(cast.alpha, gpu_large)
    young = TrainingJob.objects.create(model=job.model, run=job.run, groups=[], config={})
    _age(job, 120)
    with _workers_listening("train"):
        assert queues.warn_unserved_queues() == ["gpu-large"]
        assert queues.warn_unserved_queues() == []
    (event,) = _unserved_events(job.run)
    assert event.data == {"queue_unserved": "gpu-large", "training_job": job.pk}
    assert "training job" in event.message
    job.refresh_from_db()
    assert job.status == "failed" and "No worker is listening on queue 'gpu-large'" in job.error
    (failed,) = job.events.filter(type="training_failed")
    assert "celery -A artweb worker -Q gpu-large" in failed.data["error_message"]
    young.refresh_from_db()
    assert young.status == "queued"  # it has not waited the timeout yet


def test_the_beat_schedule_runs_the_check_on_the_housekeeping_queue(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["warn-unserved-queues"]
    assert entry["task"] == "training.warn_unserved_queues"
    assert settings.CELERY_TASK_ROUTES[entry["task"]] == {"queue": "default"}
    assert app.tasks[entry["task"]].name == "training.warn_unserved_queues"
