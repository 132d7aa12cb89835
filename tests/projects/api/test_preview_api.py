"""``/v1/preview/`` (OpenPipe ART's ServerlessBackend protocol) over HTTP with the alice/bob/charlie
cast: register (return existing, 409s, 400s naming the field), step 0 at once, checkpoints in both
orders with cursors and their deletion, training jobs (400 naming the bad place, 409 against a
platform run), events, logs, the body limit; and a walk of every preview route: another team's
key 404, a viewer or read-only key 403 on writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.urls import get_resolver

from projects import services
from projects.errors import Conflict
from projects.models import (
    Checkpoint,
    ClientLog,
    Run,
    RunKind,
    TrainableModel,
    TrainingJob,
    TrainingJobEventType,
)
from tests.conftest import _client, error_of
from tests.factories import BaseModelFactory, RunFactory

pytestmark = pytest.mark.django_db

MODELS = "/v1/preview/models"
JOBS = "/v1/preview/training-jobs"


@pytest.fixture
def base(db):
    return BaseModelFactory(name="tiny")


@pytest.fixture
def beta_client(cast):
    return _client(key=services.api_key_create(team=cast.beta, name="beta").plaintext)


def register(client, **body: Any):
    return client.post(
        MODELS,
        {
            "entity": None,
            "project": "games",
            "name": "agent",
            "base_model": "tiny",
            "return_existing": True,
            **body,
        },
        format="json",
    )


def choice(text: str = "hi", **extra: Any) -> dict:
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": "stop",
        "logprobs": {
            "content": [{"token": text, "logprob": -0.5, "bytes": list(text.encode()), "top_logprobs": []}]
        },
        **extra,
    }


def groups(*rewards: float) -> list[dict]:
    trajectories = [
        {"messages_and_choices": [{"role": "user", "content": "Hello"}, choice()], "reward": reward}
        for reward in rewards or (0.0, 1.0)
    ]
    return [{"trajectories": trajectories, "exceptions": [], "metadata": {}, "metrics": {}, "logs": []}]


def job_body(model_id: str, **extra: Any) -> dict:
    return {
        "model_id": model_id,
        "trajectory_groups": groups(),
        "experimental_config": {"learning_rate": 1e-5},
        **extra,
    }


@pytest.fixture
def registered(cast, base, key_client) -> dict:
    response = register(key_client)
    assert response.status_code == 200, response.json()
    return response.json()


# --- models ----------------------------------------------------------------------------------


def test_register_creates_the_project_model_and_client_run_and_step_0_answers_at_once(
    registered, key_client, cast
):
    assert registered["entity"] == "alpha" and (registered["project"], registered["name"]) == (
        "games",
        "agent",
    )
    assert isinstance(registered["id"], str) and isinstance(registered["run_id"], str)
    run = Run.objects.get(pk=int(registered["run_id"]))
    assert (
        run.kind == RunKind.CLIENT
        and run.model_id == int(registered["id"])
        and run.project.team == cast.alpha
    )
    # ART's get_step: the first of limit=1, order=desc.
    page = key_client.get(f"{MODELS}/{registered['id']}/checkpoints", {"limit": 1, "order": "desc"}).json()
    assert [c["step"] for c in page["data"]] == [0] and isinstance(page["data"][0]["id"], str)
    assert Checkpoint.objects.get(model_id=int(registered["id"])).path == ""  # the base model: no files


def test_register_returns_the_existing_model_and_refuses_another_base_model(registered, key_client):
    again = register(key_client, entity="alpha")
    assert again.status_code == 200 and again.json()["id"] == registered["id"]
    assert again.json()["run_id"] == registered["run_id"]
    BaseModelFactory(name="other")
    response = register(key_client, base_model="other")
    assert response.status_code == 409 and error_of(response)["code"] == "base_model_mismatch"
    response = register(key_client, return_existing=False)
    assert response.status_code == 409 and error_of(response)["code"] == "model_exists"


def test_register_names_what_is_wrong(cast, base, key_client):
    response = register(key_client, base_model="gpt-9")
    error = error_of(response)
    assert response.status_code == 400 and error["param"] == "base_model" and "tiny" in error["message"]
    assert error_of(register(key_client, project="a/b"))["param"] == "project"
    assert error_of(register(key_client, project="x" * 201))["param"] == "project"
    assert error_of(register(key_client, name="two\nlines"))["param"] == "name"
    assert error_of(register(key_client, name=None))["param"] == "name"
    assert error_of(register(key_client, return_existing="yes"))["param"] == "return_existing"
    for entity in ("beta", "nobody"):  # another team's name reads like a missing one
        response = register(key_client, entity=entity)
        assert response.status_code == 404 and error_of(response)["param"] == "entity"


def test_delete_model_removes_it_with_its_runs_and_files(
    registered, key_client, settings, tmp_path, django_capture_on_commit_callbacks
):
    settings.CHECKPOINT_DIR = tmp_path
    root = tmp_path / f"model-{registered['id']}"
    root.mkdir()
    with django_capture_on_commit_callbacks(execute=True):
        response = key_client.delete(f"{MODELS}/{registered['id']}")
    assert response.status_code == 200 and response.json()["deleted"] is True
    assert not root.exists()
    assert not Run.objects.filter(model_id=int(registered["id"])).exists()
    assert key_client.delete(f"{MODELS}/{registered['id']}").status_code == 404


def test_a_model_training_cannot_be_deleted(registered, key_client):
    assert key_client.post(JOBS, job_body(registered["id"]), format="json").status_code == 200
    response = key_client.delete(f"{MODELS}/{registered['id']}")
    assert response.status_code == 409 and error_of(response)["code"] == "model_busy"


# --- checkpoints -----------------------------------------------------------------------------


def _checkpoints(model_id: str, steps: list[int], root: Path) -> None:
    model = Checkpoint.objects.get(model_id=int(model_id), step=0).model
    for step in steps:
        path = root / f"step-{step:06d}"
        path.mkdir(parents=True)
        services.checkpoint_record(model=model, run=None, step=step, path=str(path))


def test_checkpoints_page_in_either_order_with_string_cursors(registered, key_client, settings, tmp_path):
    settings.CHECKPOINT_DIR = tmp_path
    _checkpoints(registered["id"], [1, 2, 3], tmp_path)
    url = f"{MODELS}/{registered['id']}/checkpoints"
    first = key_client.get(url, {"limit": 2, "order": "desc"}).json()
    assert [c["step"] for c in first["data"]] == [3, 2] and first["has_more"] is True
    rest = key_client.get(url, {"limit": 2, "order": "desc", "after": first["last_id"]}).json()
    assert [c["step"] for c in rest["data"]] == [1, 0] and rest["has_more"] is False
    assert [c["step"] for c in key_client.get(url).json()["data"]] == [0, 1, 2, 3]
    assert error_of(key_client.get(url, {"order": "sideways"}))["param"] == "order"


def test_deleting_checkpoints_removes_their_files_never_the_latest(
    registered, key_client, settings, tmp_path, django_capture_on_commit_callbacks
):
    settings.CHECKPOINT_DIR = tmp_path
    _checkpoints(registered["id"], [1, 2], tmp_path)
    url = f"{MODELS}/{registered['id']}/checkpoints"
    response = key_client.delete(url, {"steps": [2]}, format="json")
    assert response.status_code == 409 and error_of(response)["code"] == "checkpoint_in_use"
    assert "latest" in error_of(response)["message"]
    with_files = tmp_path / "step-000001"
    with django_capture_on_commit_callbacks(execute=True):  # the files go after the rows
        response = key_client.delete(url, {"steps": [0, 1, 7]}, format="json")
    assert response.json() == {"deleted_count": 2, "not_found_steps": [7]}
    assert not with_files.exists()
    assert [c["step"] for c in key_client.get(url).json()["data"]] == [2]
    assert error_of(key_client.delete(url, {"steps": "all"}, format="json"))["param"] == "steps"


# --- training jobs -------------------------------------------------------------------------


def test_a_training_job_is_queued_after_commit_and_its_events_page(
    registered, key_client, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = key_client.post(JOBS, job_body(registered["id"]), format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert isinstance(body["id"], str) and body["status"] == "queued" and len(callbacks) == 1
    job = TrainingJob.objects.get(pk=int(body["id"]))
    assert job.config["loss_type"] == "cispo" and job.config["learning_rate"] == 1e-5
    services.training_job_started(job=job, num_sequences=1)
    services.training_job_fail(job_id=job.pk, error="boom")
    events = key_client.get(f"{JOBS}/{body['id']}/events").json()
    assert [e["type"] for e in events["data"]] == [TrainingJobEventType.TRAINING_STARTED, "training_failed"]
    assert events["data"][1]["data"] == {"error_message": "boom"}
    after = key_client.get(f"{JOBS}/{body['id']}/events", {"after": events["data"][0]["id"]}).json()
    assert [e["type"] for e in after["data"]] == ["training_failed"]
    assert key_client.get(f"{JOBS}/{body['id']}").json()["status"] == "failed"


def test_a_bad_upload_is_400_naming_its_place(registered, key_client):
    bad = groups()
    bad[0]["trajectories"][1]["messages_and_choices"][1]["token_ids"] = ["x"]
    response = key_client.post(JOBS, job_body(registered["id"], trajectory_groups=bad), format="json")
    assert response.status_code == 400
    assert (
        error_of(response)["param"]
        == "trajectory_groups[0].trajectories[1].messages_and_choices[1].token_ids"
    )
    # One trajectory without logprobs is skipped by the job (as ART does); none with any is a 400.
    for trajectory in bad[0]["trajectories"]:
        trajectory["messages_and_choices"][1]["logprobs"] = None
        trajectory["messages_and_choices"][1].pop("token_ids", None)
    response = key_client.post(JOBS, job_body(registered["id"], trajectory_groups=bad), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "trajectory_groups"
    assert "logprobs" in error_of(response)["message"]
    response = key_client.post(
        JOBS,
        job_body(registered["id"], experimental_config={"kl_ref_adapter_path": "/srv/ref"}),
        format="json",
    )
    assert error_of(response)["param"] == "experimental_config.kl_ref_adapter_path"
    response = key_client.post(JOBS, job_body(registered["id"], trajectory_groups=[]), format="json")
    assert error_of(response)["param"] == "trajectory_groups"
    response = key_client.post(JOBS, job_body("nope"), format="json")
    assert response.status_code == 404 and error_of(response)["param"] == "model_id"


def test_a_job_and_a_platform_run_exclude_each_other(alpha_setup, cast, key_client):
    model_id = str(alpha_setup.model.pk)
    services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="agent", base_model="tiny"
    )
    assert key_client.post(JOBS, job_body(model_id), format="json").status_code == 200
    with pytest.raises(Conflict) as busy:
        RunFactory(model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
                   reward=alpha_setup.reward)  # fmt: skip
    assert "training job" in str(busy.value)
    TrainingJob.objects.update(status="succeeded")
    RunFactory(model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
               reward=alpha_setup.reward)  # fmt: skip
    response = key_client.post(JOBS, job_body(model_id), format="json")
    assert response.status_code == 409 and "run #" in error_of(response)["message"]


def test_the_body_limit_is_a_clear_413(registered, key_client, settings):
    settings.PREVIEW_MAX_BODY_BYTES = 2048
    response = key_client.post(
        JOBS, job_body(registered["id"], trajectory_groups=groups(*[0.5] * 40)), format="json"
    )
    assert response.status_code == 413
    assert "PREVIEW_MAX_BODY_BYTES" in error_of(response)["message"]


def test_logged_groups_are_kept_without_asking_for_logprobs(registered, key_client):
    logged = groups(0.25, 0.75)
    logged[0]["trajectories"][0]["messages_and_choices"][1]["logprobs"] = None
    url = f"{MODELS}/{registered['id']}/log"
    response = key_client.post(url, {"model_id": registered["id"], "trajectory_groups": logged, "split": "val"},
                               format="json")  # fmt: skip
    assert response.status_code == 200, response.json()
    log = ClientLog.objects.get()
    assert (log.split, log.step, log.trajectory_count, log.reward_mean) == ("val", 0, 2, 0.5)
    assert error_of(key_client.post(url, {"trajectory_groups": logged}, format="json"))["param"] == "split"


# --- the walk --------------------------------------------------------------------------------


def preview_patterns() -> list[tuple[str, Any]]:
    found = []
    for entry in get_resolver().url_patterns:
        if str(entry.pattern) == "v1/":
            found += [
                (str(inner.pattern), inner)
                for inner in entry.url_patterns
                if str(inner.pattern).startswith("preview/")
            ]
    return found


def test_every_preview_route_is_team_scoped(
    registered, key_client, beta_client, read_only_client, bob_client
):
    """Another team's key: 404 on every method of every route (the routes without an id name
    alpha's model in the body); a read-only key and a viewer: 403 on every write; the owner reads."""
    from projects.api.base import TeamViewSet

    job = key_client.post(JOBS, job_body(registered["id"]), format="json").json()
    ids = {"<int:model_id>": registered["id"], "<int:job_id>": job["id"]}
    bodies = {
        "preview/models": {"entity": "alpha", "project": "games", "name": "agent", "base_model": "tiny",
                           "return_existing": True},
        "preview/training-jobs": job_body(registered["id"]),
    }  # fmt: skip
    problems, checked = [], 0
    patterns = preview_patterns()
    assert len(patterns) == 7, [route for route, _ in patterns]
    for route, entry in patterns:
        assert issubclass(entry.callback.cls, TeamViewSet), route
        url = "/v1/" + route
        for placeholder, value in ids.items():
            url = url.replace(placeholder, value)
        for method in [m for m in list(entry.callback.actions) if m != "head"]:
            body = bodies.get(route, {"steps": [0], "split": "val", "trajectory_groups": groups()})
            status = getattr(beta_client, method)(url, body, format="json").status_code
            checked += 1
            if status != 404:
                problems.append(f"outsider {method.upper()} {url} → {status}, not 404")
            if method == "get":
                if key_client.get(url).status_code != 200:
                    problems.append(f"owner GET {url} → {key_client.get(url).status_code}")
                continue
            for who, client in (("read-only key", read_only_client), ("viewer", bob_client)):
                answered = getattr(client, method)(url, body, format="json").status_code
                if answered != 403:
                    problems.append(f"{who} {method.upper()} {url} → {answered}, not 403")
    assert not problems, "\n".join(problems)
    assert checked == 9


def test_any_name_art_accepts_registers_and_replies_as_sent(cast, base, key_client):
    response = register(key_client, project="My Games", name="Run #2 (α)")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["project"], body["name"]) == ("My Games", "Run #2 (α)")
    model = TrainableModel.objects.get(pk=int(body["id"]))
    assert model.project.name.startswith("my-games-") and model.name.startswith("run-2-")
    again = register(key_client, project="My Games", name="Run #2 (α)").json()
    assert again["id"] == body["id"]  # the same name maps to the same model
    other = register(key_client, project="My Games", name="Run #2 (β)").json()
    assert other["id"] != body["id"]  # names that differ never share a model
    assert register(key_client, project="games", name="agent").json()["name"] == "agent"  # slugs as they are
