"""Agent RFT through the API: a fine-tuning job with `method.reinforcement.tools` trains in an
http_tools environment made for it (header values encrypted at rest, masked in every answer, sent
decrypted to the tool's endpoint), bad tools are a 400 naming the field, and the same kind works as
a project environment through /api/v1/environments/ (masked headers kept, not carried to another
URL). The environment's HTTP behaviour itself: tests/training/environments/test_env_http_tools.py."""

from __future__ import annotations

import json

import pytest

from projects import environment_config, services
from projects.models import Environment, Run
from tests.conftest import error_of
from tests.projects.api.test_fine_tuning_api import (  # noqa: F401  (fixtures)
    RL_ROWS,
    STRING_CHECK,
    _connection_kept_open,
    bad_request,
    client_for,
    upload,
)
from tests.training.environments.test_env_http_tools import ToolServer
from training.rollouts.tools import ToolCall

pytestmark = pytest.mark.django_db

SECRET = "Bearer s3cret-tool-token"


@pytest.fixture
def ft(alpha_key, tiny_model_dir):
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    return client_for(alpha_key)


@pytest.fixture
def server():
    running = ToolServer()
    yield running
    running.close()


def agent_method(tools, **extra) -> dict:
    return {"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK, "tools": tools, **extra}}


def test_a_job_with_tools_trains_in_its_own_http_tools_environment(ft, server):
    tools = [
        {"name": "lookup", "description": "Stock of an item.", "server_url": server.url + "/echo",
         "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}},
         "headers": {"Authorization": SECRET}},
        {"type": "function", "function": {"name": "read", "description": "Read a page.", "strict": False},
         "server_url": server.url + "/text"},
    ]  # fmt: skip
    train = upload(ft, RL_ROWS)
    job = ft.fine_tuning.jobs.create(
        model="tiny",
        training_file=train.id,
        method=agent_method(tools, max_episode_steps=6, max_tool_calls=50),
    )
    run = Run.objects.select_related("environment").get(pk=int(job.id.removeprefix("ftjob-")))
    environment = run.environment
    assert environment.kind == "http_tools" and environment.max_turns == 6
    assert environment.config["max_tool_calls"] == 50
    # At rest: ciphertext only; in the job's answers: masked.
    assert SECRET not in json.dumps(environment.config)
    assert set(environment.config["tools"][0]) == {
        "name",
        "description",
        "parameters",
        "server_url",
        "headers_encrypted",
    }
    echoed = job.to_dict()["method"]["reinforcement"]
    assert echoed["max_episode_steps"] == 6 and echoed["max_tool_calls"] == 50
    assert echoed["tools"][0]["headers"] == {"Authorization": "********"}
    assert echoed["tools"][1] == {"name": "read", "description": "Read a page.", "server_url": server.url + "/text",
                                  "parameters": {"type": "object", "properties": {}}}  # fmt: skip
    for answer in (ft.fine_tuning.jobs.retrieve(job.id), *ft.fine_tuning.jobs.list()):
        assert "s3cret" not in json.dumps(answer.to_dict())
    # The worker's environment sends the decrypted header, with the rollout and call ids.
    built = services.environment_build(environment=environment)
    state = built.start({"prompt": "Stock of A-1?", "item": {"answer": "3"}})
    reply = built.respond(state, "", [ToolCall("call_1_0", "lookup", {"sku": "A-1"}, '{"sku": "A-1"}')])
    assert json.loads(reply.messages[0]["content"])["echo"] == {"sku": "A-1"}
    (request,) = server.requests
    assert request["headers"]["Authorization"] == SECRET
    assert (
        request["headers"]["X-Rollout-Id"] == state.data["rollout_id"]
        and request["headers"]["X-Call-Id"] == "call_1_0"
    )
    # Each job gets its own environment; a job without tools keeps the shared one-turn chat.
    again = ft.fine_tuning.jobs.create(model="tiny", training_file=train.id, method=agent_method(tools))
    plain = ft.fine_tuning.jobs.create(
        model="tiny",
        training_file=train.id,
        method={"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}},
    )
    again_run, plain_run = (Run.objects.get(pk=int(j.id.removeprefix("ftjob-"))) for j in (again, plain))
    assert again_run.environment_id != environment.pk and again_run.environment.max_turns == 4
    assert (plain_run.environment.kind, plain_run.environment.name) == ("chat", "fine-tuning-chat")
    assert "tools" not in plain.to_dict()["method"]["reinforcement"]


def test_bad_tools_are_a_400_naming_the_field(ft, server, settings):
    rl = upload(ft, RL_ROWS).id
    good = {"name": "lookup", "server_url": server.url + "/echo"}
    where = "method.reinforcement"
    cases = {
        f"{where}.tools": agent_method("lookup"),
        f"{where}.tools[0].server_url": agent_method([{**good, "server_url": "ftp://example.com/"}]),
        f"{where}.tools[1].name": agent_method([good, {**good, "name": "two words"}]),
        f"{where}.tools[0].function.name": agent_method(
            [{"type": "function", "function": {"name": "a b"}, "server_url": server.url}]
        ),  # fmt: skip
        f"{where}.tools[0].type": agent_method([{"type": "retrieval", "server_url": server.url}]),
        f"{where}.tools[0].function.strict": agent_method(
            [{"type": "function", "server_url": server.url, "function": {"name": "a", "strict": True}}]
        ),  # fmt: skip
        f"{where}.tools[0].headers.X-Rollout-Id": agent_method(
            [{**good, "headers": {"X-Rollout-Id": "mine"}}]
        ),
        f"{where}.tools[0].server_url ": agent_method(
            [{**good, "server_url": server.url + "/echo?api_key=k"}]
        ),
        f"{where}.max_episode_steps": agent_method([good], max_episode_steps=51),
        f"{where}.max_tool_calls": agent_method([good], max_tool_calls=0),
        f"{where}.max_episode_steps ": {
            "type": "reinforcement",
            "reinforcement": {"grader": STRING_CHECK, "max_episode_steps": 3},
        },  # fmt: skip
        f"{where}.tools ": agent_method([good, good]),  # names must be unique
    }
    for field, method in cases.items():
        error = bad_request(
            lambda method=method: ft.fine_tuning.jobs.create(model="tiny", training_file=rl, method=method)
        )
        assert error["param"] == field.strip(), (field, error)
    settings.OUTBOUND_ALLOW = ()  # loopback is no public address: refused by the operator's policy
    error = bad_request(
        lambda: ft.fine_tuning.jobs.create(model="tiny", training_file=rl, method=agent_method([good]))
    )
    assert error["param"] == f"{where}.tools[0].server_url" and "loopback" in error["message"], error
    assert not Run.objects.exists() and not Environment.objects.filter(kind="http_tools").exists()


# --- the same kind as a project environment ---------------------------------------------------


def create(client, project: int, config: dict, **fields):
    body = {"project": project, "name": "tools", "kind": "http_tools", "config": config, **fields}
    return client.post("/api/v1/environments/", body, format="json")


def tools_config(url: str, **headers) -> dict:
    return {"tools": [{"name": "lookup", "server_url": url, "headers": headers or {"Authorization": SECRET}}]}


def stored_tool_headers(environment_id: int) -> dict:
    config = environment_config.config_for_build(Environment.objects.get(pk=environment_id).config)
    return config["tools"][0].get("headers", {})


def test_an_http_tools_environment_keeps_its_header_values_encrypted_and_masked(
    alpha_setup, alice_client, bob_client
):
    url = "http://127.0.0.1:9/tool"
    created = create(alice_client, alpha_setup.project.pk, tools_config(url), max_turns=6)
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["kind"] == "http_tools" and body["max_turns"] == 6
    assert body["config"]["tools"][0]["headers"] == {"Authorization": "********"}
    environment_id = body["id"]
    for client in (alice_client, bob_client):  # owner and viewer
        for path in (f"/api/v1/environments/{environment_id}/", "/api/v1/environments/"):
            response = client.get(path)
            assert response.status_code == 200 and "s3cret" not in response.content.decode()
    row = Environment.objects.get(pk=environment_id).config
    assert "s3cret" not in json.dumps(row) and "headers_encrypted" in row["tools"][0]
    assert stored_tool_headers(environment_id) == {"Authorization": SECRET}
    path = f"/api/v1/environments/{environment_id}/"
    # The config as GET shows it, sent back: the masked value is kept; another field changes.
    config = alice_client.get(path).json()["config"]
    config["tools"][0]["description"] = "Stock of an item."
    kept = alice_client.patch(path, {"config": config}, format="json")
    assert kept.status_code == 200, kept.content
    assert stored_tool_headers(environment_id) == {"Authorization": SECRET}
    assert alice_client.patch(path, {"system_prompt": "Use the tools."}, format="json").status_code == 200
    assert stored_tool_headers(environment_id) == {"Authorization": SECRET}
    # Not to another URL: a moved tool needs its values again.
    moved = {"tools": [{"name": "lookup", "server_url": "http://127.0.0.1:10/tool"}]}
    refused = alice_client.patch(path, {"config": moved}, format="json")
    assert refused.status_code == 400 and error_of(refused)["param"] == "config.tools[0].headers"
    masked = tools_config("http://127.0.0.1:10/tool", Authorization="********")
    refused = alice_client.patch(path, {"config": masked}, format="json")
    assert (
        refused.status_code == 400 and error_of(refused)["param"] == "config.tools[0].headers.Authorization"
    )
    assert bob_client.patch(path, {"config": moved}, format="json").status_code == 403
    given = alice_client.patch(
        path, {"config": tools_config("http://127.0.0.1:10/tool", Authorization="new")}, format="json"
    )
    assert given.status_code == 200 and stored_tool_headers(environment_id) == {"Authorization": "new"}


def test_http_tools_environment_urls_are_checked_on_write(alpha_setup, alice_client, settings):
    project = alpha_setup.project.pk
    cases = {
        "config.tools[0].server_url": tools_config("http://user:pw@127.0.0.1:9/tool"),
        "config.tools": {"tools": []},
        "tools": None,
    }
    for field, config in cases.items():
        response = (
            create(alice_client, project, config)
            if config is not None
            else create(alice_client, project, tools_config("http://127.0.0.1:9/t"), tools=["lookup"])
        )
        assert response.status_code == 400 and error_of(response)["param"] == field, (field, response.content)
    settings.OUTBOUND_ALLOW = ()
    refused = create(alice_client, project, tools_config("http://127.0.0.1:9/tool"))
    assert refused.status_code == 400 and error_of(refused)["param"] == "config.tools[0].server_url"
    assert "OUTBOUND_ALLOW" in error_of(refused)["message"]
    kinds = {entry["kind"]: entry for entry in alice_client.get("/api/v1/environment-kinds").json()["data"]}
    assert (
        "server_url" in kinds["http_tools"]["config"]["tools"]
        and "max_tool_calls" in kinds["http_tools"]["config"]
    )
