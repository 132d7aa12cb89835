"""A run's ETA comes from its recorded steps' own durations alone (selectors.run_seconds_left): the
run page and the fine-tuning job's ``estimated_finish`` once spread the session opening and the
step-0 evaluation over every step (1:08:42 shown at step 1 of 20 with 6.4 minutes left). The
terminal (``up`` / ``demo``) redraws the current phase with a running clock."""

from __future__ import annotations

import datetime as dt
import io

import pytest
from django.test import Client
from django.utils import timezone

from artweb.management.commands import demo as demo_command
from projects import selectors, services
from projects.models import Run, RunStatus, StepMetrics

pytestmark = pytest.mark.django_db


@pytest.fixture
def run_at_step_1(alpha_setup, cast, monkeypatch):
    """Step 1 of 20 recorded in 20 s, after 30 minutes of opening the session and evaluating step 0."""
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 20}, created_by=cast.alice,
    )  # fmt: skip
    now = timezone.now()
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, started_at=now - dt.timedelta(minutes=30), current_step=1, heartbeat_at=now
    )
    StepMetrics.objects.create(run=run, step=1, reward_mean=0.5, metrics={"step_seconds": 20.0})
    run.refresh_from_db()
    return run


def test_the_eta_is_the_mean_step_time_times_the_steps_left(run_at_step_1):
    assert selectors.run_seconds_left(run=run_at_step_1) == pytest.approx(19 * 20.0)
    StepMetrics.objects.create(run=run_at_step_1, step=2, metrics={"step_seconds": 40.0})
    Run.objects.filter(pk=run_at_step_1.pk).update(current_step=2)
    run_at_step_1.refresh_from_db()
    assert selectors.run_seconds_left(run=run_at_step_1) == pytest.approx(18 * 30.0)


def test_no_eta_before_the_first_step_or_once_the_run_is_not_running(run_at_step_1):
    StepMetrics.objects.filter(run=run_at_step_1).delete()
    assert selectors.run_seconds_left(run=run_at_step_1) is None  # the load says nothing of a step
    StepMetrics.objects.create(run=run_at_step_1, step=1, metrics={"step_seconds": 20.0})
    Run.objects.filter(pk=run_at_step_1.pk).update(status=RunStatus.PAUSED)
    run_at_step_1.refresh_from_db()
    assert selectors.run_seconds_left(run=run_at_step_1) is None


def test_the_run_page_shows_the_eta_from_step_times(cast, run_at_step_1):
    client = Client()
    client.force_login(cast.alice)
    page = client.get(f"/runs/{run_at_step_1.pk}/live").content.decode()
    assert "ETA 0:06:20" in page  # 19 steps x 20 s; elapsed / done gave 9:30:00


def test_the_fine_tuning_job_estimates_its_finish_from_step_times(run_at_step_1):
    from projects.api.fine_tuning import job_body

    Run.objects.filter(pk=run_at_step_1.pk).update(
        fine_tuning={"model": "m", "training_file": 1, "method": {"type": "reinforcement", "reinforcement": {
            "hyperparameters": {}}}}
    )  # fmt: skip
    run_at_step_1.refresh_from_db()
    body = job_body(run_at_step_1)
    assert body["estimated_finish"] == int(run_at_step_1.heartbeat_at.timestamp() + 19 * 20)


def test_the_terminal_shows_the_current_phase_with_a_running_clock(run_at_step_1, monkeypatch, capsys):
    StepMetrics.objects.filter(run=run_at_step_1).delete()
    Run.objects.filter(pk=run_at_step_1.pk).update(current_step=0)
    event = services.run_event_add(
        run=run_at_step_1,
        message="Opening the run's session on the trainer service (x)",
        data={"phase": "loading"},
    )
    opened = timezone.now() - dt.timedelta(seconds=103)
    type(event).objects.filter(pk=event.pk).update(created_at=opened)

    class Stack:  # the stack stops after three redraws, 10 s apart
        calls = 0

        def check_alive(self):
            Stack.calls += 1
            if Stack.calls == 3:
                raise RuntimeError("stop watching")

    ticks = iter(opened + dt.timedelta(seconds=103 + 10 * i) for i in range(10))
    monkeypatch.setattr(demo_command.timezone, "now", lambda: next(ticks))
    monkeypatch.setattr(demo_command.time, "sleep", lambda seconds: None)
    with pytest.raises(RuntimeError, match="stop watching"):
        demo_command.watch_run(run_at_step_1, stack=Stack(), stdout=io.StringIO(), timeout_s=60)
    drawn = capsys.readouterr().err
    for shown in ("1:43", "1:53", "2:03"):  # redrawn while no step and no event came
        assert f"Opening the run's session on the trainer service (x) {shown}" in drawn


def test_the_eta_follows_the_latest_steps_when_steps_get_shorter(run_at_step_1):
    """The demo's steps shorten as its replies do (18 s to 5 s here): at step 11 of 40 the mean of
    every step said 4:48 with 2 minutes left. The latest RECENT_STEPS steps say what the next cost,
    on the run page (selectors.run_seconds_left) and the terminal (demo.eta_text) alike."""
    durations = [60.0, 60.0, 60.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    StepMetrics.objects.filter(run=run_at_step_1).delete()
    for step, seconds in enumerate(durations, start=1):
        StepMetrics.objects.create(run=run_at_step_1, step=step, metrics={"step_seconds": seconds})
    Run.objects.filter(pk=run_at_step_1.pk).update(current_step=len(durations))
    run_at_step_1.refresh_from_db()
    assert selectors.run_seconds_left(run=run_at_step_1) == pytest.approx(12 * 5.0)  # the mean said 12 x 26.9
    assert demo_command.eta_text(durations, 12) == "eta 1:00"
    assert demo_command.eta_text(durations[:2], 12) == "eta 12:00"  # fewer steps than the window: all of them


def test_a_phase_cut_to_fit_the_bar_says_it_was_cut(run_at_step_1):
    """The newcomer rerun's bar read "Opening the run's session on the trainer service (bundled:s
    0:34": the phase was cut at 59 characters and the "…" saying so stripped with the phase's own."""
    from projects.models import RunEvent

    Run.objects.filter(pk=run_at_step_1.pk).update(status=RunStatus.RUNNING)
    run_at_step_1.refresh_from_db()
    long = RunEvent(
        message="Opening the run's session on the trainer service (bundled:smollm2-135m-instruct)"
    )
    long.created_at = timezone.now()
    shown = demo_command.now_text(run_at_step_1, long, long.created_at + dt.timedelta(seconds=34))
    assert shown == "Opening the run's session on the trainer service (bundled:s… 0:34"
    short = RunEvent(message="Loading the model…")
    short.created_at = long.created_at
    assert demo_command.now_text(run_at_step_1, short, short.created_at) == "Loading the model 0:00"
