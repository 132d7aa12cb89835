"""A client run (an ART model's training jobs, a Tinker training client) has a life cycle: a user
stops it over REST (its unfinished training jobs fail, a Tinker client's further training requests
are refused), its client closes it, or it ends once its client has been idle for
CLIENT_RUN_IDLE_S; an ART client's next job then starts a new client run."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from projects import services
from projects.errors import ValidationFailed
from projects.models import Run, RunEvent, RunStatus, TinkerSession, TrainingJob, TrainingJobStatus
from projects.services.client_models import client_run_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def art(cast):
    services.base_model_register(name="tiny", source="/nonexistent/tiny")
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="agent", base_model="tiny"
    )
    return model, run


@pytest.fixture
def tinker(cast):
    services.base_model_register(name="tiny", source="/nonexistent/tiny")
    session = services.tinker_session_create(team=cast.alpha, project=None, tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    return services.tinker_model_create(session=session, model_seq_id=0, base_model="tiny", lora_config={})


def _age(run: Run, seconds: float) -> None:
    """Make everything the client did ``seconds`` old."""
    then = timezone.now() - timedelta(seconds=seconds)
    Run.objects.filter(pk=run.pk).update(created_at=then, started_at=then, heartbeat_at=then)
    TinkerSession.objects.filter(models__run=run).update(heartbeat_at=then)
    TrainingJob.objects.filter(run=run).update(finished_at=then)


def test_an_art_client_run_is_stopped_over_rest_and_its_next_job_starts_a_new_run(art, key_client):
    model, run = art
    job = TrainingJob.objects.create(model=model, run=run, groups=[], config={})
    response = key_client.post(f"/api/v1/runs/{run.pk}/cancel/")
    assert response.status_code == 200, response.json()
    assert response.json()["status"] == "cancelled"
    job.refresh_from_db()
    assert job.status == TrainingJobStatus.FAILED and f"client run #{run.pk} ended" in job.error
    again = key_client.post(f"/api/v1/runs/{run.pk}/cancel/")
    assert again.status_code == 409
    successor = client_run_of(model)
    assert successor.pk != run.pk and successor.status == RunStatus.RUNNING


def test_a_tinker_client_run_is_stopped_over_rest_and_its_training_requests_are_refused(
    tinker, key_client, cast, bob_client, charlie_client
):
    assert charlie_client.post(f"/api/v1/runs/{tinker.run.pk}/cancel/").status_code == 404
    assert bob_client.post(f"/api/v1/runs/{tinker.run.pk}/cancel/").status_code == 403
    response = key_client.post(f"/api/v1/runs/{tinker.run.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    with pytest.raises(ValidationFailed, match="cancelled: its training requests are refused") as caught:
        services.tinker_future_submit(team=cast.alpha, kind="forward_backward", model=tinker, seq_id=1)
    assert caught.value.field == "model_id"


def test_a_closed_tinker_session_ends_its_run_through_the_state_machine(tinker):
    services.tinker_session_finish(session=tinker.session, reason="errored", detail="boom")
    run = Run.objects.get(pk=tinker.run.pk)
    assert run.status == RunStatus.FAILED and run.finished_at is not None and "boom" in run.error
    assert RunEvent.objects.filter(run=run, data__to=RunStatus.FAILED).exists()


def test_idle_client_runs_end_and_busy_or_recent_ones_stay(art, tinker, settings):
    settings.CLIENT_RUN_IDLE_S = 600
    model, art_run = art
    _age(art_run, 700)
    _age(tinker.run, 700)
    TinkerSession.objects.filter(pk=tinker.session.pk).update(heartbeat_at=timezone.now())  # still there
    job = TrainingJob.objects.create(model=model, run=art_run, groups=[], config={})
    assert services.client_runs_close_idle() == []  # a queued job and a live session
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJobStatus.SUCCEEDED)
    _age(art_run, 700)
    assert services.client_runs_close_idle() == [art_run.pk]
    _age(tinker.run, 700)
    assert services.client_runs_close_idle() == [tinker.run.pk]
    for run in (art_run, tinker.run):
        ended = Run.objects.get(pk=run.pk)
        assert ended.status == RunStatus.SUCCEEDED and ended.finished_at is not None
        assert "idle for over 600 s (CLIENT_RUN_IDLE_S)" in ended.events.order_by("-id").first().message


def test_the_sweep_is_a_beat_task(settings):
    from projects.jobs import tasks

    assert tasks.close_idle_client_runs.name == "training.close_idle_client_runs"
    assert any(
        entry["task"] == "training.close_idle_client_runs" for entry in settings.CELERY_BEAT_SCHEDULE.values()
    )
