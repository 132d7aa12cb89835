"""Unknown fields are refused on every write, as the run config refuses an unknown hyperparameter:
a 400 naming the field, with the closest valid name ("did you mean max_new_tokens?"), never a
default used in silence (issue 24: ``max_new_tokns`` ran with 32 tokens)."""

from __future__ import annotations

from typing import Any

import pytest
from django.urls import reverse

from projects import services
from projects.models import Evaluation, Project, TrainingJob
from tests.conftest import error_of
from tests.projects import test_tenancy_walk as walk
from tests.projects.api.test_preview_api import groups, job_body
from tests.projects.test_tenancy_walk import PUBLIC, _api_methods, _url, api_patterns

pytestmark = pytest.mark.django_db

world = walk.world  # one of every team-owned object (the tenancy walk's fixture)

UNKNOWN = "bogus_field"
WRITES = {"post", "put", "patch"}
# The one preview write whose body travels on a DELETE (ART deletes checkpoints with {steps}).
BODY_ON_DELETE = {"preview-checkpoints"}


def _refused(response: Any, field: str) -> str | None:
    """None when ``response`` is the 400 naming ``field`` as unknown, else what it was instead."""
    if response.status_code != 400:
        return f"{response.status_code} {response.content[:300]!r}"
    error = error_of(response)
    if error["param"] != field or "unknown field" not in error["message"]:
        return f"400 on {error['param']!r}: {error['message']}"
    return None


def _preview_routes(world: Any, cast: Any) -> list[tuple[str, str, str]]:
    """(method, url, name) of every write under /v1/preview/."""
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="client", base_model=world.setup.base.name
    )
    job = TrainingJob.objects.create(model=model, run=run)
    ids = {"model_id": model.pk, "job_id": job.pk}
    from projects.gateway.urls import preview_urlpatterns

    routes = []
    for entry in preview_urlpatterns:
        kwargs = {key: ids[key] for key in entry.pattern.regex.groupindex}
        url = reverse(entry.name, kwargs=kwargs)
        for method in _api_methods(entry):
            if method in WRITES or (method == "delete" and entry.name in BODY_ON_DELETE):
                routes.append((method, url, entry.name))
    return routes


def test_every_write_refuses_an_unknown_field_naming_it(world, cast, alice_client, key_client):
    """Every POST, PUT and PATCH of /api/v1 (and ART's preview protocol under /v1/preview), sent
    one key no route has: each answers 400 with that key as ``param``."""
    problems: list[str] = []
    walked = 0
    for _route, entry, name in api_patterns():
        if name in PUBLIC:
            continue
        url = _url(world, entry, name, entry.callback.cls)
        for method in _api_methods(entry):
            if method not in WRITES:
                continue
            walked += 1
            response = getattr(alice_client, method)(url, {UNKNOWN: 1}, format="json")
            if problem := _refused(response, UNKNOWN):
                problems.append(f"{method.upper()} {url}: {problem}")
    for method, url, _name in _preview_routes(world, cast):
        walked += 1
        response = getattr(key_client, method)(url, {UNKNOWN: 1}, format="json")
        if problem := _refused(response, UNKNOWN):
            problems.append(f"{method.upper()} {url}: {problem}")
    assert not problems, "writes that took an unknown field:\n" + "\n".join(problems)
    assert walked >= 40, f"the walk reached only {walked} writes"


def _evaluation_body(setup: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "math/agent:0", "task_set": setup.task_set.pk, "environment": setup.environment.pk,
            "reward": setup.reward.pk, **extra}  # fmt: skip


@pytest.fixture
def checkpointed(alpha_setup):
    from tests.factories import CheckpointFactory

    CheckpointFactory(model=alpha_setup.model, step=0)
    return alpha_setup


def test_a_misspelt_evaluation_setting_is_refused_with_the_name_it_meant(checkpointed, key_client):
    response = key_client.post(
        "/api/v1/evaluations/", _evaluation_body(checkpointed, max_new_tokns=64), format="json"
    )
    assert response.status_code == 400, response.json()
    error = error_of(response)
    assert error["param"] == "max_new_tokns"
    assert error["message"].endswith("did you mean max_new_tokens?"), error["message"]
    assert not Evaluation.objects.exists()  # nothing ran with the default of 32
    spelt = key_client.post(
        "/api/v1/evaluations/", _evaluation_body(checkpointed, max_new_tokens=64), format="json"
    )
    assert spelt.status_code == 201, spelt.json()
    assert Evaluation.objects.get().config["max_new_tokens"] == 64


def test_an_unknown_field_is_reported_with_the_other_problems_it_comes_first(checkpointed, key_client):
    body = _evaluation_body(checkpointed, temprature=0.5, samples_per_row=0)
    error = error_of(key_client.post("/api/v1/evaluations/", body, format="json"))
    assert error["param"] == "temprature" and "did you mean temperature?" in error["message"]
    assert set(error["fields"]) == {"temprature", "samples_per_row"}


def test_an_unknown_field_of_a_nested_object_names_its_path(checkpointed, key_client):
    body = _evaluation_body(checkpointed, reference={"checkpont": 1})
    error = error_of(key_client.post("/api/v1/evaluations/", body, format="json"))
    assert error["param"] == "reference.checkpont" and "did you mean checkpoint?" in error["message"]


def test_project_writes_refuse_a_misspelt_field(cast, key_client):
    created = key_client.post(
        "/api/v1/projects/", {"name": "support", "descripton": "help desk"}, format="json"
    )
    assert created.status_code == 400, created.json()
    error = error_of(created)
    assert error["param"] == "descripton" and "did you mean description?" in error["message"]
    assert not Project.objects.exists()
    project = key_client.post("/api/v1/projects/", {"name": "support"}, format="json").json()
    updated = key_client.patch(f"/api/v1/projects/{project['id']}/", {"nme": "desk"}, format="json")
    assert updated.status_code == 400 and error_of(updated)["param"] == "nme"
    assert "did you mean name?" in error_of(updated)["message"]
    assert Project.objects.get().name == "support"


def test_an_action_without_a_body_refuses_any_field_and_takes_an_empty_one(alpha_setup, key_client):
    body = {"model": alpha_setup.model.pk, "task_set": alpha_setup.task_set.pk,
            "environment": alpha_setup.environment.pk, "reward": alpha_setup.reward.pk}  # fmt: skip
    run = key_client.post("/api/v1/runs/", body, format="json").json()
    refused = key_client.post(f"/api/v1/runs/{run['id']}/cancel/", {"reason": "typo"}, format="json")
    assert refused.status_code == 400 and error_of(refused)["param"] == "reason"
    assert "takes no body" in error_of(refused)["message"]
    assert key_client.get(f"/api/v1/runs/{run['id']}/").json()["status"] == "queued"
    assert key_client.post(f"/api/v1/runs/{run['id']}/cancel/").json()["status"] == "cancelled"


def test_art_client_bodies_are_taken_and_a_misspelt_key_is_refused(cast, alpha_setup, key_client):
    """Every key ART 0.5.18's client sends (art/serverless/client.py: the log repeats the URL's
    model_id), and a misspelt one on each of its writes."""
    sent = {"entity": None, "project": "math", "name": "client", "base_model": alpha_setup.base.name,
            "return_existing": False}  # fmt: skip
    misspelt = key_client.post("/v1/preview/models", {**sent, "base_modle": "tiny"}, format="json")
    assert misspelt.status_code == 400, misspelt.json()
    assert error_of(misspelt)["param"] == "base_modle"
    assert "did you mean base_model?" in error_of(misspelt)["message"]
    model = key_client.post("/v1/preview/models", sent, format="json")
    assert model.status_code == 200, model.json()
    model_id = model.json()["id"]
    log_url = f"/v1/preview/models/{model_id}/log"
    log = {"model_id": model_id, "trajectory_groups": groups(0.25, 0.75), "split": "val"}
    assert key_client.post(log_url, log, format="json").status_code == 200
    refused = key_client.post(log_url, {**log, "splt": "val"}, format="json")
    assert error_of(refused)["param"] == "splt" and "did you mean split?" in error_of(refused)["message"]
    job = job_body(model_id)
    refused = key_client.post("/v1/preview/training-jobs", {**job, "experimental_confg": {}}, format="json")
    assert error_of(refused)["param"] == "experimental_confg"
    assert "did you mean experimental_config?" in error_of(refused)["message"]
    assert key_client.post("/v1/preview/training-jobs", job, format="json").status_code == 200
    checkpoints = f"/v1/preview/models/{model_id}/checkpoints"
    refused = key_client.delete(checkpoints, {"step": [1]}, format="json")
    assert error_of(refused)["param"] == "step" and "did you mean steps?" in error_of(refused)["message"]
    assert key_client.delete(checkpoints, {"steps": []}, format="json").status_code == 200
