"""A resumed run's page: its elapsed time leaves out the time it was paused, and a warning its
learning-signal watcher gave again after the resume is one banner, not two."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone

from projects import services
from projects.models import Run, RunEvent, RunStatus
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


@pytest.fixture
def resumed_run(alpha_setup, cast, monkeypatch):
    """Started 30 minutes ago, paused from minute 5 to minute 15 (resumed, then claimed again)."""
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 20}, created_by=cast.alice,
    )  # fmt: skip
    start = timezone.now() - dt.timedelta(minutes=30)
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, started_at=start, heartbeat_at=timezone.now()
    )
    for minute, previous, to in (
        (5, "running", "paused"),
        (14, "paused", "queued"),
        (15, "queued", "running"),
    ):
        event = services.run_event_add(run=run, message=f"to {to}", data={"from": previous, "to": to})
        RunEvent.objects.filter(pk=event.pk).update(created_at=start + dt.timedelta(minutes=minute))
    run.refresh_from_db()
    return run


def test_the_elapsed_time_leaves_out_the_pause(cast, resumed_run):
    elapsed = client_for(cast.alice).get(f"/runs/{resumed_run.pk}/").context["elapsed"]
    assert dt.timedelta(minutes=19, seconds=50) <= elapsed <= dt.timedelta(minutes=20, seconds=10)
    # Paused now (since minute 25): the clock stops.
    event = services.run_event_add(
        run=resumed_run, message="to paused", data={"from": "running", "to": "paused"}
    )
    RunEvent.objects.filter(pk=event.pk).update(created_at=resumed_run.started_at + dt.timedelta(minutes=25))
    Run.objects.filter(pk=resumed_run.pk).update(status=RunStatus.PAUSED)
    elapsed = client_for(cast.alice).get(f"/runs/{resumed_run.pk}/").context["elapsed"]
    assert dt.timedelta(minutes=14, seconds=50) <= elapsed <= dt.timedelta(minutes=15, seconds=10)


def test_a_warning_given_again_after_the_resume_is_one_banner(cast, resumed_run):
    for step in (3, 9):  # before the pause, and again by the fresh watcher after the resume
        services.run_event_add(
            run=resumed_run, level="warn", message=f"No learning signal up to step {step}",
            data={"signal": "zero_variance", "step": step, "grader": "exact"},
        )  # fmt: skip
    html = client_for(cast.alice).get(f"/runs/{resumed_run.pk}/").content.decode()
    assert html.count('data-signal="zero_variance"') == 1
    assert (
        "No learning signal up to step 9" in html
        and "up to step 3" not in html.split('<ol class="events"')[0]
    )
