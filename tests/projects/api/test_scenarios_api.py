"""POST /api/v1/task-sets/generate against a local OpenAI-compatible server with scripted replies:
valid rows become a task set whose source holds the per-row report; bad input 400 naming the field,
other teams' objects unusable, viewers and read-only keys 403."""

from __future__ import annotations

import json

import pytest

from projects.models import TaskRow, TaskSet
from projects.services import judges
from tests.conftest import error_of
from tests.openai_stub import openai_stub

pytestmark = pytest.mark.django_db


def row(prompt: str, answer: str) -> str:
    return json.dumps({"prompt": prompt, "item": {"answer": answer}})


@pytest.fixture
def stub_endpoint(cast):
    def make(replies, **fields):
        context = openai_stub(replies)
        stub = context.__enter__()
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha,
            name=fields.pop("name", "writer"),
            base_url=stub.url,
            api_key="sk-writer",
            default_model=fields.pop("default_model", "writer-model"),
            **fields,
        )
        contexts.append(context)
        return stub, endpoint

    contexts: list = []
    yield make
    for context in contexts:
        context.__exit__(None, None, None)


def body(setup, writer, **changes):
    data = {
        "project": setup.project.id,
        "environment": setup.environment.id,
        "endpoint": writer.id,
        "n": 3,
        "instruction": "single-word answers",
        "name": "generated",
    }
    data.update(changes)
    return data


def test_generate_saves_valid_rows_and_reports_the_rest(alice_client, alpha_setup, stub_endpoint):
    reply = "\n".join(
        [
            row("Say yes", "yes"),
            '{"prompt": "Say no", "item": ',  # malformed
            row("Say maybe", "maybe"),
            json.dumps({"prompt": "Say hi", "item": {"answer": "hi"}, "extra": 1}),  # not an upload row
            row("say YES", "yes"),  # duplicate
            row("Say later", "later"),
        ]
    )
    stub, endpoint = stub_endpoint([reply])
    response = alice_client.post("/api/v1/task-sets/generate", body(alpha_setup, endpoint), format="json")
    assert response.status_code == 201, response.json()
    created = response.json()
    assert created["name"] == "generated" and created["row_count"] == 3
    source = created["source"]
    assert (
        source["type"] == "generated" and source["endpoint"] == "writer" and source["model"] == "writer-model"
    )
    assert (source["requested"], source["accepted"], source["rejected"]) == (3, 3, 3)
    errors = [(e["row"], e["field"], e["error"].split(":")[0]) for e in source["errors"]]
    assert errors == [
        (2, "", "malformed JSON"),
        (4, "extra", "unknown field (allowed"),
        (5, "prompt", "duplicate of accepted row 1"),
    ]
    rows = list(
        TaskRow.objects.filter(task_set_id=created["id"]).order_by("index").values_list("data", flat=True)
    )
    assert [r["prompt"] for r in rows] == ["Say yes", "Say maybe", "Say later"]
    assert stub.requests[0]["model"] == "writer-model"
    assert stub.headers[0]["Authorization"] == "Bearer sk-writer", "the stored key is decrypted for the call"
    assert "sk-writer" not in response.content.decode()


def test_no_valid_row_is_400_with_every_row_error_and_no_task_set(alice_client, alpha_setup, stub_endpoint):
    _, endpoint = stub_endpoint(["[1, 2]", "nothing useful", '{"item": {}}'])
    response = alice_client.post("/api/v1/task-sets/generate", body(alpha_setup, endpoint), format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "instruction" and "no valid task rows" in error["message"]
    assert "rows[1.1]" in error["fields"] and "rows[3.1]" in error["fields"]
    assert not TaskSet.objects.filter(name="generated").exists()


def test_an_endpoint_that_fails_every_request_is_400_on_endpoint(alice_client, alpha_setup, stub_endpoint):
    _, endpoint = stub_endpoint([404, 404, 404])
    response = alice_client.post("/api/v1/task-sets/generate", body(alpha_setup, endpoint), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "endpoint"
    assert "HTTP 404" in error_of(response)["message"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 101}, "n"),
        ({"name": "Bad Name"}, "name"),
        ({"name": "qa"}, "name"),  # exists
        ({"instruction": "   "}, "instruction"),
        ({"endpoint": 999999}, "endpoint"),
        ({"environment": 999999}, "environment"),
        ({"validation_fraction": 1.0}, "validation_fraction"),
    ],
)
def test_bad_input_is_400_naming_the_field(alice_client, alpha_setup, stub_endpoint, changes, field):
    stub, endpoint = stub_endpoint([])
    response = alice_client.post(
        "/api/v1/task-sets/generate", body(alpha_setup, endpoint, **changes), format="json"
    )
    assert response.status_code == 400, response.json()
    assert error_of(response)["param"] == field
    assert stub.requests == [], "nothing is generated for a request that is invalid up front"


def test_endpoint_without_a_default_model_needs_model(alice_client, alpha_setup, stub_endpoint):
    stub, endpoint = stub_endpoint([row("Say ok", "ok")], name="bare", default_model="")
    response = alice_client.post(
        "/api/v1/task-sets/generate", body(alpha_setup, endpoint, n=1), format="json"
    )
    assert error_of(response)["param"] == "model"
    response = alice_client.post(
        "/api/v1/task-sets/generate", body(alpha_setup, endpoint, n=1, model="chosen"), format="json"
    )
    assert response.status_code == 201 and stub.requests[0]["model"] == "chosen"


def test_outsiders_cannot_use_our_project_or_endpoint(charlie_client, alpha_setup, stub_endpoint, cast):
    stub, endpoint = stub_endpoint([row("Say ok", "ok")])
    response = charlie_client.post("/api/v1/task-sets/generate", body(alpha_setup, endpoint), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "project"
    assert stub.requests == []
    assert charlie_client.get(f"/api/v1/task-sets/{alpha_setup.task_set.id}/").status_code == 404


def test_viewers_and_read_only_keys_get_403(bob_client, read_only_client, alpha_setup, stub_endpoint):
    stub, endpoint = stub_endpoint([])
    for client in (bob_client, read_only_client):
        response = client.post("/api/v1/task-sets/generate", body(alpha_setup, endpoint), format="json")
        assert response.status_code == 403 and error_of(response)["type"] == "permission_error"
    assert stub.requests == []
