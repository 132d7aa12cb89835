"""One numbering of steps on the run page of a run that continues a model: the model's step (the
number its checkpoints carry) in the status line and in every step event, with the run's own
count beside it ("Step 23 (3 of 3 in this run)"), never "Step 3/3" next to "Step 23/23"."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from projects import services
from projects.models import RunEvent
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def test_a_continuing_runs_page_names_steps_by_the_models_step(cast, alpha_setup, tmp_path):
    factories.CheckpointFactory(model=alpha_setup.model, step=20)  # what earlier runs left
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 3}, created_by=cast.alice,
    )  # fmt: skip
    assert run.start_step == 20
    claimed = services.run_claim(run_id=run.pk, worker="w1")
    assert claimed is not None
    for step in (21, 22, 23):
        path = tmp_path / f"step-{step}"
        path.mkdir()
        assert services.step_record(
            run=claimed, worker="w1", step=step, trajectories=[], checkpoint_path=str(path),
            metrics={"reward_mean": 0.25, "loss": 0.5, "trainable_tokens": 8.0},
        )  # fmt: skip
    client = Client()
    client.force_login(cast.alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    status = html.split('class="step-position">')[1].split("</span>")[0]
    assert status == "Step 23 (3 of 3 in this run)"
    steps = [e.message for e in RunEvent.objects.filter(run=run, type="metrics").order_by("id")]
    assert steps == [
        "Step 21 (1 of 3 in this run): reward 0.25, loss 0.5",
        "Step 22 (2 of 3 in this run): reward 0.25, loss 0.5",
        "Step 23 (3 of 3 in this run): reward 0.25, loss 0.5",
    ]
    # No line on the page counts the run's steps as if they were the model's.
    assert not re.search(r"Step [0-3]/3\b", html), html
    assert "step 23" in html  # the checkpoint chip: the same number


def test_a_run_from_the_base_model_keeps_its_short_step_line(cast, alpha_setup, tmp_path):
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 20}, created_by=cast.alice,
    )  # fmt: skip
    claimed = services.run_claim(run_id=run.pk, worker="w1")
    path = tmp_path / "step-1"
    path.mkdir()
    assert services.step_record(
        run=claimed, worker="w1", step=1, trajectories=[], checkpoint_path=str(path),
        metrics={"reward_mean": 0.5, "loss": 0.1, "trainable_tokens": 8.0},
    )  # fmt: skip
    client = Client()
    client.force_login(cast.alice)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    assert html.split('class="step-position">')[1].split("</span>")[0] == "Step 1/20"
    assert RunEvent.objects.filter(run=run, type="metrics").get().message == "Step 1/20: reward 0.5, loss 0.1"
