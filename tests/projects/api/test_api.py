"""Every endpoint: happy path, outsider 404, viewer / read-only 403, bad input 400 naming the field."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from projects import services
from projects.models import ApiKey, Run
from tests.conftest import REWARD_SPEC, error_of

pytestmark = pytest.mark.django_db


# --- authentication -------------------------------------------------------------------------


def test_anonymous_request_is_rejected(anonymous_client):
    response = anonymous_client.get("/api/v1/projects/")
    assert response.status_code in (401, 403)
    assert error_of(response)["type"] in {"authentication_error", "permission_error"}


def test_unknown_api_key_gets_401(anonymous_client):
    anonymous_client.credentials(HTTP_AUTHORIZATION="Bearer aw_000000000000_nope")
    response = anonymous_client.get("/api/v1/projects/")
    assert response.status_code == 401
    assert "invalid" in error_of(response)["message"]


def test_api_key_is_stored_hashed_and_updates_last_used(cast, key_client, alpha_key):
    key = ApiKey.objects.get(team=cast.alpha, name="ci")
    assert alpha_key not in key.key_hash and key.prefix in alpha_key
    assert key.last_used_at is None
    assert key_client.get("/api/v1/projects/").status_code == 200
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_revoked_key_stops_working(cast, alice_client):
    created = alice_client.post("/api/v1/api-keys/", {"name": "temp"}, format="json")
    assert created.status_code == 201
    plaintext = created.json()["key"]
    assert plaintext.startswith("aw_")
    listed = alice_client.get("/api/v1/api-keys/").json()["data"]
    assert all("key" not in row for row in listed), "the plaintext key must only be shown at creation"
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/v1/projects/").status_code == 200
    assert alice_client.post(f"/api/v1/api-keys/{created.json()['id']}/revoke/").status_code == 200
    assert client.get("/api/v1/projects/").status_code == 401


def test_only_owners_manage_api_keys(bob_client, key_client, charlie_client, cast):
    assert bob_client.post("/api/v1/api-keys/", {"name": "x"}, format="json").status_code == 403
    assert key_client.post("/api/v1/api-keys/", {"name": "x"}, format="json").status_code == 403
    alpha_key_id = services.api_key_create(team=cast.alpha, name="k").api_key.pk
    assert charlie_client.post(f"/api/v1/api-keys/{alpha_key_id}/revoke/").status_code == 404


def test_session_user_picks_team_with_header(cast, alice_client):
    gamma = services.team_create(name="gamma", owner=cast.alice)
    services.project_create(team=gamma, name="in-gamma")
    services.project_create(team=cast.alpha, name="in-alpha")
    names = [p["name"] for p in alice_client.get("/api/v1/projects/", HTTP_X_TEAM="gamma").json()["data"]]
    assert names == ["in-gamma"]
    # Two teams and no X-Team: the API does not guess (issue 12: never an alphabetical fallback).
    unnamed = alice_client.get("/api/v1/projects/")
    assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "X-Team"
    assert alice_client.get("/api/v1/projects/", HTTP_X_TEAM="beta").status_code == 403


# --- projects -------------------------------------------------------------------------------


def test_project_crud(alice_client):
    created = alice_client.post("/api/v1/projects/", {"name": "agents", "description": "d"}, format="json")
    assert created.status_code == 201, created.json()
    project_id = created.json()["id"]
    assert alice_client.get(f"/api/v1/projects/{project_id}/").json()["name"] == "agents"
    updated = alice_client.patch(f"/api/v1/projects/{project_id}/", {"description": "new"}, format="json")
    assert updated.json()["description"] == "new"
    assert alice_client.delete(f"/api/v1/projects/{project_id}/").status_code == 204
    assert alice_client.get(f"/api/v1/projects/{project_id}/").status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [({"name": "Bad Name!"}, "name"), ({}, "name"), ({"name": "x" * 80}, "name")],
)
def test_project_bad_input_names_the_field(alice_client, body, field):
    response = alice_client.post("/api/v1/projects/", body, format="json")
    assert response.status_code == 400
    assert error_of(response)["param"] == field


def test_duplicate_project_name_is_400(alice_client):
    assert alice_client.post("/api/v1/projects/", {"name": "p"}, format="json").status_code == 201
    response = alice_client.post("/api/v1/projects/", {"name": "p"}, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "name"


def test_malformed_json_is_400(alice_client):
    response = alice_client.post("/api/v1/projects/", data='{"name": ', content_type="application/json")
    assert response.status_code == 400
    assert "JSON" in error_of(response)["message"]


# --- tenancy and roles on every resource ----------------------------------------------------

DETAIL_URLS = [
    "/api/v1/projects/{project}/",
    "/api/v1/models/{model}/",
    "/api/v1/models/{model}/checkpoints/",
    "/api/v1/reward-definitions/{reward}/",
    "/api/v1/reward-definitions/{reward}/versions/",
    "/api/v1/task-sets/{task_set}/",
    "/api/v1/task-sets/{task_set}/rows/",
    "/api/v1/environments/{environment}/",
    "/api/v1/runs/{run}/",
    "/api/v1/runs/{run}/events/",
    "/api/v1/runs/{run}/metrics/",
    "/api/v1/runs/{run}/checkpoints/",
    "/api/v1/runs/{run}/trajectories/",
]


def _ids(setup) -> dict[str, int]:
    run = Run.objects.create(
        project=setup.project, model=setup.model, task_set=setup.task_set, environment=setup.environment,
        reward=setup.reward, config={}, total_steps=1,
    )  # fmt: skip
    return {
        "project": setup.project.pk, "model": setup.model.pk, "reward": setup.reward.pk,
        "task_set": setup.task_set.pk, "environment": setup.environment.pk, "run": run.pk,
    }  # fmt: skip


@pytest.mark.parametrize("url", DETAIL_URLS)
def test_outsider_gets_404_and_member_gets_200(alpha_setup, charlie_client, bob_client, url):
    ids = _ids(alpha_setup)
    assert charlie_client.get(url.format(**ids)).status_code == 404
    assert bob_client.get(url.format(**ids)).status_code == 200


WRITES = [
    ("patch", "/api/v1/projects/{project}/", {"description": "x"}),
    ("delete", "/api/v1/projects/{project}/", None),
    ("patch", "/api/v1/models/{model}/", {"lora": {"rank": 4}}),
    ("delete", "/api/v1/models/{model}/", None),
    ("patch", "/api/v1/reward-definitions/{reward}/", {"spec": REWARD_SPEC}),
    ("delete", "/api/v1/reward-definitions/{reward}/", None),
    ("delete", "/api/v1/task-sets/{task_set}/", None),
    ("patch", "/api/v1/environments/{environment}/", {"max_turns": 2}),
    ("delete", "/api/v1/environments/{environment}/", None),
    ("post", "/api/v1/runs/{run}/cancel/", None),
]


@pytest.mark.parametrize(("method", "url", "body"), WRITES)
def test_viewer_and_read_only_key_cannot_write(alpha_setup, bob_client, read_only_client, method, url, body):
    ids = _ids(alpha_setup)
    for client in (bob_client, read_only_client):
        response = getattr(client, method)(url.format(**ids), body, format="json")
        assert response.status_code == 403, (client, response.content)


@pytest.mark.parametrize(("method", "url", "body"), WRITES)
def test_outsider_cannot_write(alpha_setup, charlie_client, method, url, body):
    ids = _ids(alpha_setup)
    assert getattr(charlie_client, method)(url.format(**ids), body, format="json").status_code == 404


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/api/v1/projects/", {"name": "new"}),
        ("/api/v1/models/", {"project": 0, "name": "m", "base_model": "tiny"}),
        ("/api/v1/task-sets/", {"project": 0, "name": "t", "rows": [{"prompt": "p"}]}),
        ("/api/v1/environments/", {"project": 0, "name": "e"}),
        ("/api/v1/reward-definitions/", {"project": 0, "name": "r", "spec": REWARD_SPEC}),
    ],
)
def test_viewer_cannot_create(alpha_setup, bob_client, read_only_client, url, body):
    for client in (bob_client, read_only_client):
        assert client.post(url, body, format="json").status_code == 403


def test_lists_show_only_own_team(alpha_setup, charlie_client, key_client):
    _ids(alpha_setup)
    for url in ["projects", "models", "reward-definitions", "task-sets", "environments", "runs"]:
        assert charlie_client.get(f"/api/v1/{url}/").json()["data"] == [], url
        assert len(key_client.get(f"/api/v1/{url}/").json()["data"]) >= 1, url


def test_referencing_another_teams_project_is_rejected(alpha_setup, charlie_client):
    response = charlie_client.post(
        "/api/v1/environments/", {"project": alpha_setup.project.pk, "name": "e"}, format="json"
    )
    assert response.status_code == 400
    assert error_of(response)["param"] == "project"


# --- models ---------------------------------------------------------------------------------


def test_model_create_and_validation(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    ok = alice_client.post(
        "/api/v1/models/",
        {"project": project, "name": "m2", "base_model": "tiny", "lora": {"rank": 4}},
        format="json",
    )
    assert ok.status_code == 201, ok.json()
    assert ok.json()["lora"]["rank"] == 4 and ok.json()["latest_step"] is None
    unknown = alice_client.post(
        "/api/v1/models/", {"project": project, "name": "m3", "base_model": "gpt-9"}, format="json"
    )
    assert unknown.status_code == 400 and error_of(unknown)["param"] == "base_model"
    bad_lora = alice_client.post(
        "/api/v1/models/",
        {"project": project, "name": "m4", "base_model": "tiny", "lora": {"rank": -1}},
        format="json",
    )
    assert bad_lora.status_code == 400 and error_of(bad_lora)["param"] == "lora.rank"
    listed = alice_client.get(f"/api/v1/models/?project={project}").json()
    assert {m["name"] for m in listed["data"]} == {"agent", "m2"}


@pytest.mark.parametrize("devices", [0, 17, "two", True, 1.5])
def test_a_models_devices_must_be_a_whole_number_from_1_to_16(alpha_setup, alice_client, devices):
    project = alpha_setup.project.pk
    created = alice_client.post(
        "/api/v1/models/",
        {"project": project, "name": "dp", "base_model": "tiny", "devices": devices},
        format="json",
    )
    assert created.status_code == 400 and error_of(created)["param"] == "devices", created.json()
    model = alpha_setup.model
    changed = alice_client.patch(f"/api/v1/models/{model.pk}/", {"devices": devices}, format="json")
    assert changed.status_code == 400 and error_of(changed)["param"] == "devices", changed.json()
    model.refresh_from_db()
    assert model.devices == 1


def test_a_models_devices_are_set_at_creation_and_changed_later(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    created = alice_client.post(
        "/api/v1/models/",
        {"project": project, "name": "dp", "base_model": "tiny", "devices": 2},
        format="json",
    )
    assert created.status_code == 201 and created.json()["devices"] == 2, created.json()
    default = alice_client.post("/api/v1/models/", {"project": project, "name": "one", "base_model": "tiny"},
                                format="json")  # fmt: skip
    assert default.json()["devices"] == 1
    changed = alice_client.patch(f"/api/v1/models/{created.json()['id']}/", {"devices": 4}, format="json")
    assert changed.status_code == 200 and changed.json()["devices"] == 4


def test_a_models_fsdp_needs_several_devices_at_creation_and_after_a_change(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    alone = alice_client.post("/api/v1/models/", {"project": project, "name": "one", "base_model": "tiny",
                                                  "fsdp": True}, format="json")  # fmt: skip
    assert alone.status_code == 400 and error_of(alone)["param"] == "fsdp"
    assert "devices of 2 or more" in error_of(alone)["message"]
    wrong = alice_client.post("/api/v1/models/", {"project": project, "name": "one", "base_model": "tiny",
                                                  "devices": 2, "fsdp": "maybe"}, format="json")  # fmt: skip
    assert wrong.status_code == 400 and error_of(wrong)["param"] == "fsdp"
    created = alice_client.post("/api/v1/models/", {"project": project, "name": "sharded", "base_model": "tiny",
                                                    "devices": 2, "fsdp": True}, format="json")  # fmt: skip
    assert created.status_code == 201 and created.json()["fsdp"] is True, created.json()
    url = f"/api/v1/models/{created.json()['id']}/"
    fewer = alice_client.patch(url, {"devices": 1}, format="json")  # would leave fsdp on one device
    assert fewer.status_code == 400 and error_of(fewer)["param"] == "fsdp"
    changed = alice_client.patch(url, {"devices": 1, "fsdp": False}, format="json")
    assert changed.status_code == 200 and (changed.json()["devices"], changed.json()["fsdp"]) == (1, False)
    assert alice_client.get(url).json()["fsdp"] is False


def test_base_models_are_listed(alpha_setup, key_client):
    assert [m["name"] for m in key_client.get("/api/v1/base-models/").json()["data"]] == ["tiny"]


# --- reward definitions ---------------------------------------------------------------------


def test_reward_definition_versions(alpha_setup, alice_client):
    reward_id = alpha_setup.reward.pk
    spec2 = {**REWARD_SPEC, "operation": "eq"}
    updated = alice_client.patch(f"/api/v1/reward-definitions/{reward_id}/", {"spec": spec2}, format="json")
    assert updated.status_code == 201
    assert updated.json()["version"] == 2 and updated.json()["spec"]["operation"] == "eq"
    versions = alice_client.get(f"/api/v1/reward-definitions/{reward_id}/versions/").json()
    assert [v["version"] for v in versions["data"]] == [1, 2]
    assert versions["data"][0]["spec"]["operation"] == "ilike", "version 1 must stay as it was"
    latest = alice_client.get("/api/v1/reward-definitions/?latest=true").json()["data"]
    assert [(r["name"], r["version"]) for r in latest] == [("exact", 2)]


def test_invalid_grader_spec_names_the_path(alpha_setup, alice_client):
    response = alice_client.post(
        "/api/v1/reward-definitions/",
        {"project": alpha_setup.project.pk, "name": "bad", "spec": {"type": "regex", "pattern": "(unclosed"}},
        format="json",
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "spec.pattern", error
    unknown_type = alice_client.post(
        "/api/v1/reward-definitions/",
        {"project": alpha_setup.project.pk, "name": "bad2", "spec": {"type": "nope"}},
        format="json",
    )
    assert unknown_type.status_code == 400 and error_of(unknown_type)["param"].startswith("spec")


# --- task sets ------------------------------------------------------------------------------


def test_task_set_upload_as_json_jsonl_and_file(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    rows = [
        {"prompt": "a", "item": {"x": 1}},
        {"messages": [{"role": "user", "content": "b"}], "split": "validation"},
    ]
    as_json = alice_client.post(
        "/api/v1/task-sets/", {"project": project, "name": "j", "rows": rows}, format="json"
    )
    assert as_json.status_code == 201, as_json.json()
    assert (as_json.json()["train_count"], as_json.json()["validation_count"]) == (1, 1)
    jsonl = "\n".join(json.dumps(r) for r in rows)
    as_text = alice_client.post(
        "/api/v1/task-sets/", {"project": project, "name": "t", "jsonl": jsonl}, format="json"
    )
    assert as_text.status_code == 201 and as_text.json()["row_count"] == 2
    upload = SimpleUploadedFile("tasks.jsonl", jsonl.encode(), content_type="application/jsonl")
    as_file = alice_client.post(
        "/api/v1/task-sets/", {"project": project, "name": "f", "file": upload}, format="multipart"
    )
    assert as_file.status_code == 201, as_file.json()
    listed = alice_client.get(f"/api/v1/task-sets/{as_file.json()['id']}/rows/?split=validation").json()
    assert len(listed["data"]) == 1 and listed["data"][0]["data"]["messages"][0]["content"] == "b"


def test_malformed_jsonl_names_line_and_field(alpha_setup, alice_client):
    jsonl = '{"prompt": "ok"}\n{"prompt": \n{"messages": "nope"}\n{"prompt": "x", "item": 3}\n'
    response = alice_client.post(
        "/api/v1/task-sets/",
        {"project": alpha_setup.project.pk, "name": "bad", "jsonl": jsonl},
        format="json",
    )
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "jsonl" or error["param"] == "file"
    assert "line 2: invalid JSON" in error["message"]
    assert "line 3: messages" in error["message"]
    assert "line 4: item: must be an object" in error["message"]


def test_binary_upload_is_a_clear_400(alpha_setup, alice_client):
    upload = SimpleUploadedFile(
        "tasks.jsonl", b"\xff\xfe\x00garbage", content_type="application/octet-stream"
    )
    response = alice_client.post(
        "/api/v1/task-sets/",
        {"project": alpha_setup.project.pk, "name": "bin", "file": upload},
        format="multipart",
    )
    assert response.status_code == 400 and error_of(response)["param"] == "file"


# --- environments ---------------------------------------------------------------------------


def test_environment_validation(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    bad_turns = alice_client.post(
        "/api/v1/environments/", {"project": project, "name": "e", "max_turns": 0}, format="json"
    )
    assert bad_turns.status_code == 400 and error_of(bad_turns)["param"] == "max_turns"
    bad_sampling = alice_client.post(
        "/api/v1/environments/",
        {"project": project, "name": "e", "sampling": {"temperature": -1}},
        format="json",
    )
    assert bad_sampling.status_code == 400 and error_of(bad_sampling)["param"] == "sampling.temperature"
    tools = alice_client.post(
        "/api/v1/environments/", {"project": project, "name": "e", "tools": [{"name": "calc"}]}, format="json"
    )
    assert tools.status_code == 400 and error_of(tools)["param"] == "tools"
    ok = alice_client.post(
        "/api/v1/environments/",
        {"project": project, "name": "e", "system_prompt": "hi", "sampling": {"stop": ["\n\n"]}},
        format="json",
    )
    assert ok.status_code == 201 and ok.json()["sampling"] == {"stop": ["\n\n"]}
