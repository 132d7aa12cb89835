"""Pause, resume, fork and ``start_from`` over REST: an outsider gets 404 and a viewer or read-only
key 403 on every action; bad input is a 400 naming the field; a state the action does not fit
(pausing a finished run, resuming a running one, "base" on a trained model) is a 409."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunStatus, TrainableModel
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

ACTIONS = [
    ("pause", None),
    ("resume", None),
    ("fork", {"from_step": 0, "name": "copy"}),
]


def body(setup, **extra):
    return {
        "model": setup.model.pk, "task_set": setup.task_set.pk, "environment": setup.environment.pk,
        "reward": setup.reward.pk, "config": {"steps": 2}, **extra,
    }  # fmt: skip


@pytest.fixture
def run(alpha_setup, settings, tmp_path) -> Run:
    """A running run whose model has a complete step 0 on disk."""
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    created = services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
        config={"steps": 2},
    )
    folder = settings.CHECKPOINT_DIR / f"model-{alpha_setup.model.pk}" / "step-000000"
    folder.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "optimizer.pt", "rng_state.pt"):
        (folder / name).write_bytes(b"x")
    (folder / "state.json").write_text(json.dumps({"step": 0}))
    services.checkpoint_record(model=alpha_setup.model, run=created, step=0, path=str(folder))
    claimed = services.run_claim(run_id=created.pk, worker="w1")
    assert claimed is not None
    return claimed


@pytest.mark.parametrize(("action", "payload"), ACTIONS)
def test_an_outsider_gets_404_on_every_action(run, charlie_client, action, payload):
    response = charlie_client.post(f"/api/v1/runs/{run.pk}/{action}/", payload, format="json")
    assert response.status_code == 404
    assert (
        Run.objects.get(pk=run.pk).status == RunStatus.RUNNING
        and not Run.objects.get(pk=run.pk).pause_requested
    )


@pytest.mark.parametrize(("action", "payload"), ACTIONS)
def test_a_viewer_and_a_read_only_key_get_403_on_every_action(
    run, bob_client, read_only_client, action, payload
):
    for client in (bob_client, read_only_client):
        response = client.post(f"/api/v1/runs/{run.pk}/{action}/", payload, format="json")
        assert response.status_code == 403, response.content
    assert not TrainableModel.objects.filter(name="copy").exists()


def test_pause_then_resume_through_the_api(run, key_client, django_capture_on_commit_callbacks):
    paused = key_client.post(f"/api/v1/runs/{run.pk}/pause/")
    assert paused.status_code == 200, paused.json()
    assert paused.json()["status"] == "running" and paused.json()["pause_requested"] is True
    services.run_pause_finish(run_id=run.pk, worker="w1")  # the worker reaches the step boundary
    assert key_client.get(f"/api/v1/runs/{run.pk}/").json()["status"] == "paused"
    again = key_client.post(f"/api/v1/runs/{run.pk}/pause/")
    assert again.status_code == 409 and error_of(again)["code"] == "invalid_transition"
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        resumed = key_client.post(f"/api/v1/runs/{run.pk}/resume/")
    assert resumed.status_code == 200 and resumed.json()["status"] == "queued"
    assert len(callbacks) == 1, "enqueued once, after commit"
    events = [e["message"] for e in key_client.get(f"/api/v1/runs/{run.pk}/events/").json()["data"]]
    assert "Run paused at checkpoint step 0; resume continues from it" in events
    assert "Run resumed: queued to continue from checkpoint step 0" in events


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled"])
def test_pausing_or_resuming_a_finished_run_is_409(run, key_client, status):
    Run.objects.filter(pk=run.pk).update(status=status)
    for action in ("pause", "resume"):
        response = key_client.post(f"/api/v1/runs/{run.pk}/{action}/")
        assert response.status_code == 409, (action, response.json())
        error = error_of(response)
        assert error["code"] == "invalid_transition" and status in error["message"]


def test_resuming_a_running_run_is_409(run, key_client):
    response = key_client.post(f"/api/v1/runs/{run.pk}/resume/")
    assert response.status_code == 409 and "only a paused run can be resumed" in error_of(response)["message"]


def test_fork_creates_a_model_and_a_queued_run_from_the_checkpoint(run, key_client, settings):
    response = key_client.post(
        f"/api/v1/runs/{run.pk}/fork/",
        {"from_step": 0, "name": "copy", "config": {"steps": 5}},
        format="json",
    )
    assert response.status_code == 201, response.json()
    forked = response.json()
    source = Checkpoint.objects.get(model=run.model, step=0)
    assert forked["status"] == "queued" and forked["total_steps"] == 5 and forked["forked_from"] == source.pk
    model = TrainableModel.objects.get(pk=forked["model"])
    assert model.name == "copy" and model.project_id == run.project_id
    copy = Path(Checkpoint.objects.get(model=model, step=0).path)
    assert copy.parent == settings.CHECKPOINT_DIR / f"model-{model.pk}" and (copy / "optimizer.pt").is_file()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"name": "copy"}, "from_step"),
        ({"from_step": -1, "name": "copy"}, "from_step"),
        ({"from_step": "two", "name": "copy"}, "from_step"),
        ({"from_step": 9, "name": "copy"}, "from_step"),
        ({"from_step": 0}, "name"),
        ({"from_step": 0, "name": "Bad Name"}, "name"),
        ({"from_step": 0, "name": "agent"}, "name"),
        ({"from_step": 0, "name": "copy", "config": {"learning_rate": "fast"}}, "config.learning_rate"),
        ({"from_step": 0, "name": "copy", "config": {"bogus": 1}}, "config.bogus"),
        ({"from_step": 0, "name": "copy", "config": []}, "config"),
    ],
)
def test_fork_bad_input_is_400_naming_the_field(run, key_client, payload, field):
    response = key_client.post(f"/api/v1/runs/{run.pk}/fork/", payload, format="json")
    assert response.status_code == 400, response.json()
    assert error_of(response)["param"] == field
    assert not TrainableModel.objects.filter(name="copy").exists()


def test_start_from_on_create(alpha_setup, key_client):
    done = Run.objects.create(
        project=alpha_setup.project, model=alpha_setup.model, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward, config={}, status="succeeded",
    )  # fmt: skip
    old = services.checkpoint_record(model=alpha_setup.model, run=done, step=0, path="/c/0")
    latest = services.checkpoint_record(model=alpha_setup.model, run=done, step=3, path="/c/3")

    for bad in (None, "newest", True, 0, [1], {"id": 1}):
        response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from=bad), format="json")
        assert response.status_code == 400, (bad, response.json())
        assert error_of(response)["param"] == "start_from"
    response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from=999999), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "start_from"

    response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from="base"), format="json")
    assert response.status_code == 409
    assert (error_of(response)["param"], error_of(response)["code"]) == (
        "start_from",
        "model_has_checkpoints",
    )
    response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from=old.pk), format="json")
    assert response.status_code == 409 and error_of(response)["code"] == "not_latest_checkpoint"

    response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from=str(latest.pk)), format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["start_step"] == 3
    services.run_cancel(run=Run.objects.get(pk=response.json()["id"]))
    response = key_client.post("/api/v1/runs/", body(alpha_setup), format="json")  # default "latest"
    assert response.status_code == 201 and response.json()["start_step"] == 3
    first = key_client.get(f"/api/v1/runs/{response.json()['id']}/events/").json()["data"][0]
    assert "starting from checkpoint step 3;" in first["message"]
    assert first["data"]["start_from"] == "latest" and first["data"]["checkpoint"] == latest.pk


def test_start_from_base_on_a_fresh_model(alpha_setup, key_client):
    response = key_client.post("/api/v1/runs/", body(alpha_setup, start_from="base"), format="json")
    assert response.status_code == 201 and response.json()["start_step"] == 0
