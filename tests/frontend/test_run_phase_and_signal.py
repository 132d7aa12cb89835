"""The run page says what the run is doing now (its latest phase event) and shows a banner for
each "no learning signal" warning; the terminal (`make up` / `manage.py demo`) prints both."""

from __future__ import annotations

import datetime as dt

import pytest
from django.test import Client

from artweb.management.commands.demo import eta_text, event_line
from projects import services
from projects.models import Run, RunEvent, RunStatus
from training.runs.learning_signal import NO_SIGNAL

pytestmark = pytest.mark.django_db


@pytest.fixture
def running_run(alpha_setup, cast, monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)
    run = services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
        config={"steps": 2},
        created_by=cast.alice,
    )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    return run


def test_run_page_shows_the_current_phase_and_the_no_signal_banner(cast, running_run):
    client = Client()
    client.force_login(cast.alice)
    services.run_event_add(run=running_run, message="Loading base model x", data={"phase": "loading"})
    services.run_event_add(
        run=running_run, message="Step 1/2: rollouts, 2 groups × 4 samples", data={"phase": "rollouts"}
    )
    page = client.get(f"/runs/{running_run.pk}/live").content.decode()
    assert 'data-phase="rollouts"' in page and "Now: Step 1/2: rollouts" in page
    assert "no-signal" not in page

    services.run_event_add(
        run=running_run,
        message=f"{NO_SIGNAL} (every sample scored 0, 3 steps in a row up to step 3; reward 'r' v1)",
        level="warn",
        data={"signal": "all_rewards_equal", "step": 3},
    )
    for path in (f"/runs/{running_run.pk}/live", f"/runs/{running_run.pk}/"):
        page = client.get(path).content.decode()
        assert 'class="notice no-signal"' in page and "no learning signal" in page, path
        assert f"/runs/{running_run.pk}/trajectories" in page


def test_terminal_lines_are_timestamped_and_the_eta_waits_for_the_first_step(running_run):
    event = RunEvent(
        run=running_run,
        message=NO_SIGNAL,
        level="warn",
        data={"signal": "zero_variance"},
        created_at=dt.datetime(2026, 1, 1, 9, 30, 5, tzinfo=dt.UTC),
    )
    assert "!!! WARNING: no learning signal" in event_line(event)
    event.level, event.data, event.message = "info", {"phase": "grading"}, "Step 1/2: grading"
    assert event_line(event).endswith("[info] Step 1/2: grading")
    assert event_line(event)[:8].count(":") == 2, "HH:MM:SS first"
    assert eta_text([], 20) == "eta after the first step"
    assert eta_text([30.0, 40.0], 18) == "eta 10:30"
