"""The run page's and the compare page's charts in Chromium, read back from Chart.js itself
(``Chart.getChart(canvas)``: the data and options the page gave it), so a test fails when the page
draws a number that misleads: a reward band below the lowest reward anyone got, a line between two
evaluations as if it were a trend, and two runs' validation rewards overlaid as comparable when
one evaluated 24 rows and the other 8.

Only the web app runs here (uvicorn on the test database): the rows are recorded in the test,
the way the compare section of test_dashboard records its second run, so no worker is needed.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model

from projects import services
from projects.models import Evaluation, Run, RunStatus, StepMetrics, Trajectory
from tests import factories
from tests.browser.conftest import _start, _wait
from tests.processes import Process, test_database_url
from tests.projects.gateway.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-chart-reader-123"


@pytest.fixture
def web(transactional_db, tmp_path) -> Iterator[Process]:
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "ARTWEB_DATA_DIR": str(tmp_path / "data"),
        "DEBUG": "1",
        "HF_HUB_OFFLINE": "1",
    }
    port = free_port()
    process = _start(
        "web",
        [
            sys.executable,
            "-m",
            "uvicorn",
            "artweb.asgi:application",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env,
        tmp_path / "web.log",
    )
    process.url = f"http://127.0.0.1:{port}"

    def ready(started: Process) -> bool:
        try:
            with urllib.request.urlopen(f"{started.url}/healthz", timeout=2):
                return True
        except OSError:
            return False

    try:
        _wait(process, ready)
        yield process
    finally:
        process.stop()


@pytest.fixture
def setup(transactional_db, settings, monkeypatch):
    """A team with one project's run inputs; its runs are recorded here, never enqueued."""
    # The web process checks the password with Django's default hashers, not the tests' MD5.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)
    reader = get_user_model().objects.create_user("reader", password=PASSWORD)
    team = services.team_create(name="charts", owner=reader)
    project = factories.ProjectFactory(team=team, name="charts")
    return type(
        "Setup",
        (),
        {
            "project": project,
            "base": factories.BaseModelFactory(name="tiny"),
            "task_set": factories.TaskSetFactory(
                project=project,
                name="thirty-two",
                rows=[{"prompt": f"q{i}", "item": {"answer": str(i)}} for i in range(32)],
                validation_fraction=0.75,
            ),
            "environment": factories.EnvironmentFactory(project=project, name="chat"),
            "reward": factories.RewardDefinitionFactory(project=project, name="exact"),
        },
    )


def finished_run(setup, name: str, *, rewards_by_step: dict[int, list[float]]) -> Run:
    """A succeeded run on a model of its own, with each step's trajectories and their mean/std."""
    model = factories.TrainableModelFactory(project=setup.project, name=name, base_model=setup.base)
    run = services.run_create(
        model=model,
        task_set=setup.task_set,
        environment=setup.environment,
        reward=setup.reward,
        config={"steps": len(rewards_by_step)},
    )
    for step, rewards in rewards_by_step.items():
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        StepMetrics.objects.create(
            run=run, step=step, reward_mean=mean, reward_std=std, metrics={"loss": 0.1, "trainable_tokens": 8}
        )
        for index, reward in enumerate(rewards):
            Trajectory.objects.create(
                run=run,
                step=step,
                group_index=0,
                sample_index=index,
                task_row_index=0,
                messages=[{"role": "assistant", "content": "x"}],
                reward=reward,
                completion_tokens=1,
            )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED, current_step=max(rewards_by_step))
    return Run.objects.get(pk=run.pk)


def evaluated(run: Run, step: int, *, rows: int, reward_mean: float) -> Evaluation:
    return Evaluation.objects.create(
        project=run.project,
        run=run,
        step=step,
        task_set=run.task_set,
        environment=run.environment,
        reward=run.reward,
        status="succeeded",
        results={"n": rows, "rows": rows, "reward_mean": reward_mean, "pass_rate": 0.0},
    )


def sign_in(browser, web: Process) -> None:
    page = browser.page
    page.goto(f"{web.url}/login/")
    page.fill("#id_username", "reader")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{web.url}/projects/")


def chart_of(page, canvas_id: str) -> dict:
    """What Chart.js holds for a canvas: per dataset its label, data and showLine; the x scale's
    type (a category axis would put steps 0 and 20 side by side)."""
    page.wait_for_function(f"() => window.Chart && Chart.getChart('{canvas_id}')")
    return page.evaluate(
        """(id) => {
          const chart = Chart.getChart(id);
          return {
            datasets: chart.data.datasets.map(d => ({label: d.label, data: d.data, showLine: d.showLine})),
            labels: chart.data.labels,
            x_type: chart.options.scales.x.type,
          };
        }""",
        canvas_id,
    )


def test_reward_band_stays_inside_the_rewards_that_were_sampled(web, setup, browser):
    # A 0/1 reward: step 1 has mean 0.25 and std 0.43, so mean - std would be -0.18; step 2 mean
    # 0.75, so mean + std would be 1.18; no sample got below 0 or above 1.
    run = finished_run(setup, "band", rewards_by_step={1: [0, 0, 0, 1], 2: [1, 1, 1, 0], 3: [0, 1, 0, 1]})
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/runs/{run.pk}/")
    chart = chart_of(page, "chart-reward")
    band = {d["label"]: d["data"] for d in chart["datasets"] if d["label"] in ("_upper", "_lower")}
    assert min(band["_lower"]) == 0 and max(band["_upper"]) == 1, band
    assert band["_lower"][0] == 0 and band["_upper"][1] == 1  # the clipped ends
    assert band["_upper"][0] == pytest.approx(0.25 + 0.75**0.5 / 2)  # the others as they were
    assert band["_lower"][2] == pytest.approx(0.0) and band["_upper"][2] == pytest.approx(1.0)
    mean = next(d["data"] for d in chart["datasets"] if d["label"] == "mean reward")
    assert mean == [0.25, 0.75, 0.5]
    note = page.locator("#note-reward")
    assert note.is_visible() and "cut at 0 and 1" in note.inner_text(), note.inner_text()
    assert browser.console_errors == [], browser.console_errors


def test_validation_chart_is_one_point_per_evaluation_on_a_step_axis(web, setup, browser):
    run = finished_run(setup, "validation", rewards_by_step={step: [0, 1] for step in range(1, 21)})
    evaluated(run, 0, rows=24, reward_mean=0.25)
    evaluated(run, 20, rows=24, reward_mean=0.354)
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/runs/{run.pk}/")
    chart = chart_of(page, "chart-validation")
    # Points at steps 0 and 20 of a linear axis, not joined by a line.
    assert chart["x_type"] == "linear"
    [validation] = chart["datasets"]
    assert validation["showLine"] is False
    assert [(p["x"], p["y"]) for p in validation["data"]] == [(0, 0.25), (20, 0.354)]
    assert "not joined" in page.locator("#note-validation").inner_text()
    assert "24 samples each" in page.locator("#note-validation").inner_text()
    assert browser.console_errors == [], browser.console_errors


def test_compare_marks_evaluations_of_different_row_counts_not_comparable(web, setup, browser):
    wide = finished_run(setup, "wide", rewards_by_step={1: [0, 1], 2: [1, 1]})
    narrow = finished_run(setup, "narrow", rewards_by_step={1: [0, 0], 2: [0, 1]})
    evaluated(wide, 2, rows=24, reward_mean=0.5)
    evaluated(narrow, 2, rows=8, reward_mean=0.75)
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/runs/compare?ids={wide.pk},{narrow.pk}")
    note = page.locator("#figure-validation .not-comparable")
    assert note.is_visible()
    text = note.inner_text()
    assert text.startswith("Not comparable")
    assert "24 validation rows of thirty-two" in text and "8 validation rows of thirty-two" in text
    chart = chart_of(page, "chart-validation")
    labels = [d["label"] for d in chart["datasets"]]
    assert labels == [
        f"#{wide.pk} wide (24 validation rows of thirty-two)",
        f"#{narrow.pk} narrow (8 validation rows of thirty-two)",
    ]
    assert all(d["showLine"] is False for d in chart["datasets"])
    # The training reward is one line per run as before.
    assert all(d["showLine"] is True for d in chart_of(page, "chart-reward")["datasets"])
    assert browser.console_errors == [], browser.console_errors


def test_compare_of_evaluations_on_the_same_rows_has_no_note(web, setup, browser):
    first = finished_run(setup, "first", rewards_by_step={1: [0, 1]})
    second = finished_run(setup, "second", rewards_by_step={1: [1, 1]})
    evaluated(first, 1, rows=24, reward_mean=0.5)
    evaluated(second, 1, rows=24, reward_mean=0.75)
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/runs/compare?ids={first.pk},{second.pk}")
    chart = chart_of(page, "chart-validation")
    assert [d["label"] for d in chart["datasets"]] == [f"#{first.pk} first", f"#{second.pk} second"]
    assert page.locator(".not-comparable").count() == 0
