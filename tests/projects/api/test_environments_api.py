"""Environments through the API: per-kind validation by the registry (400 naming the field), kind
changes taking the new kind's defaults, and the environment-kinds help for the dashboard."""

import json

import pytest
from django.test import override_settings

from projects import environment_config
from projects.models import Environment
from tests.conftest import error_of


def create(client, project: int, **fields):
    return client.post("/api/v1/environments/", {"project": project, "name": "env", **fields}, format="json")


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"kind": "poker"}, "kind", "must be one of"),
        ({"kind": "chat", "tools": ["calculator"]}, "tools", "takes no tools"),
        ({"kind": "chat", "max_turns": 2}, "max_turns", "exactly one turn"),
        ({"kind": "python_tools", "tools": ["calculator", "rm"]}, "tools", "unknown tool 'rm'"),
        ({"kind": "python_tools", "tools": [{"name": "calculator"}]}, "tools", "list of tool names"),
        ({"kind": "python_tools", "config": {"now": "soon"}}, "config.now", "ISO 8601"),
        ({"kind": "python_tools", "config": {"colour": 1}}, "config.colour", "unknown key"),
        ({"kind": "python_tools", "tool_timeout_s": 0}, "tool_timeout_s", "greater than 0"),
        ({"kind": "tic_tac_toe", "max_turns": 2}, "max_turns", "at least 5"),
        ({"kind": "tic_tac_toe", "config": {"model_mark": "Y"}}, "config.model_mark", "X, O"),
        ({"kind": "2048", "config": {"target": 100}}, "config.target", "power of two"),
        ({"kind": "mcp"}, "config", "config.command"),
        ({"kind": "mcp", "config": {"command": ["sh", "-c", "id"]}}, "config.command", "demo server"),
        ({"kind": "mcp", "config": {"url": "file:///etc/passwd"}}, "config.url", "http://"),
    ],
)
def test_bad_environment_settings_are_a_400_naming_the_field(
    alpha_setup, alice_client, fields, param, message
):
    response = create(alice_client, alpha_setup.project.pk, **fields)
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["param"] == param
    assert message in error["message"]
    assert not Environment.objects.filter(name="env").exists()


def test_each_kind_is_created_with_its_defaults(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    tools = create(alice_client, project, kind="python_tools", tools=["calculator", "lookup"])
    assert tools.status_code == 201, tools.content
    body = tools.json()
    assert (body["kind"], body["tools"], body["max_turns"], body["config"], body["tool_timeout_s"]) == (
        "python_tools", ["calculator", "lookup"], 4, {}, 10.0
    )  # fmt: skip
    game = alice_client.post(
        "/api/v1/environments/",
        {"project": project, "name": "ttt", "kind": "tic_tac_toe", "config": {"max_invalid_moves": 1}},
        format="json",
    )
    assert game.status_code == 201 and game.json()["max_turns"] == 6
    mcp = alice_client.post(
        "/api/v1/environments/",
        {
            "project": project,
            "name": "shop",
            "kind": "mcp",
            "config": {"command": ["python", "-m", "training.environments.mcp_demo.server"]},
            "tool_timeout_s": 5,
        },
        format="json",
    )
    assert mcp.status_code == 201 and mcp.json()["tool_timeout_s"] == 5.0
    # The default chat environment still works as before.
    chat = alice_client.post("/api/v1/environments/", {"project": project, "name": "plain"}, format="json")
    assert chat.status_code == 201 and chat.json()["max_turns"] == 1 and chat.json()["kind"] == "chat"


def test_changing_the_kind_takes_the_new_kinds_defaults_and_is_validated(alpha_setup, alice_client):
    url = f"/api/v1/environments/{alpha_setup.environment.pk}/"
    game = alice_client.patch(url, {"kind": "2048"}, format="json")
    assert game.status_code == 200, game.content
    assert game.json()["max_turns"] == 40
    bad = alice_client.patch(url, {"config": {"target": 3}}, format="json")
    assert bad.status_code == 400 and error_of(bad)["param"] == "config.target"
    tools = alice_client.patch(url, {"kind": "python_tools", "tools": ["clock"]}, format="json")
    assert tools.status_code == 400 and error_of(tools)["param"] == "tools"
    assert Environment.objects.get(pk=alpha_setup.environment.pk).kind == "2048"


def test_environment_kinds_lists_every_kind_with_its_help(alpha_setup, alice_client, anonymous_client):
    response = alice_client.get("/api/v1/environment-kinds")
    assert response.status_code == 200
    kinds = {entry["kind"]: entry for entry in response.json()["data"]}
    assert list(kinds) == ["chat", "python_tools", "tic_tac_toe", "2048", "mcp", "http_tools"]
    assert [tool["name"] for tool in kinds["python_tools"]["available_tools"]] == [
        "calculator", "convert_units", "lookup", "current_time"
    ]  # fmt: skip
    assert "lookup_field" in kinds["python_tools"]["config"]
    assert kinds["2048"]["default_max_turns"] == 40 and "target" in kinds["2048"]["config"]
    assert "<move>" in kinds["tic_tac_toe"]["answer"]
    assert anonymous_client.get("/api/v1/environment-kinds").status_code in (401, 403)


# --- the operator's stdio allow-list ------------------------------------------------------


def test_an_mcp_command_runs_only_a_command_the_operator_allows_matched_whole(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    allowed = {"command": ["/opt/mcp/bin/warehouse", "--stdio"]}
    refused = create(alice_client, project, kind="mcp", config=allowed)  # the default allows only the demo
    assert refused.status_code == 400 and error_of(refused)["param"] == "config.command"
    with override_settings(MCP_STDIO_PROGRAMS=("/opt/mcp/bin/warehouse --stdio",)):
        accepted = create(alice_client, project, kind="mcp", config=allowed)
        assert accepted.status_code == 201, accepted.content
        assert accepted.json()["config"]["command"] == allowed["command"]
        for other in (
            ["/opt/mcp/bin/warehouse"],
            ["/opt/mcp/bin/warehouse", "--stdio", "--plugin=/tmp/x.so"],
        ):
            extra = alice_client.post(
                "/api/v1/environments/",
                {"project": project, "name": "extra", "kind": "mcp", "config": {"command": other}},
                format="json",
            )
            assert extra.status_code == 400 and error_of(extra)["param"] == "config.command", other
        unlisted = alice_client.post(
            "/api/v1/environments/",
            {
                "project": project,
                "name": "other",
                "kind": "mcp",
                "config": {"command": ["/bin/sh", "-c", "id"]},
            },
            format="json",
        )
        assert unlisted.status_code == 400
        assert error_of(unlisted)["param"] == "config.command"
        assert "commands the operator allows" in error_of(unlisted)["message"]


# --- write-only MCP headers ---------------------------------------------------------------

SECRET = "Bearer s3cret-token-4711"
URL = "http://mcp.internal:8000/mcp"


def create_with_headers(client, project: int):
    return create(
        client,
        project,
        kind="mcp",
        config={"url": URL, "headers": {"Authorization": SECRET, "X-Team": "alpha"}},
    )


def stored_headers(environment_id: int) -> dict:
    return environment_config.config_for_build(Environment.objects.get(pk=environment_id).config)["headers"]


def test_mcp_header_values_are_never_returned_and_stored_encrypted(alpha_setup, alice_client, bob_client):
    created = create_with_headers(alice_client, alpha_setup.project.pk)
    assert created.status_code == 201, created.content
    assert created.json()["config"] == {
        "url": URL,
        "headers": {"Authorization": "********", "X-Team": "********"},
    }
    environment_id = created.json()["id"]
    for client in (alice_client, bob_client):  # owner and viewer
        for url in (f"/api/v1/environments/{environment_id}/", "/api/v1/environments/"):
            response = client.get(url)
            assert response.status_code == 200
            assert "s3cret" not in response.content.decode()
            assert "********" in response.content.decode()
    row = Environment.objects.filter(pk=environment_id).values_list("config", flat=True).get()
    assert "s3cret" not in json.dumps(row) and "alpha" not in json.dumps(row)
    assert set(row) == {"url", "headers_encrypted"}
    assert stored_headers(environment_id) == {"Authorization": SECRET, "X-Team": "alpha"}


def test_a_masked_or_omitted_header_value_keeps_the_stored_one(alpha_setup, alice_client):
    environment_id = create_with_headers(alice_client, alpha_setup.project.pk).json()["id"]
    url = f"/api/v1/environments/{environment_id}/"
    # The config as GET shows it, sent back with one value changed: the masked one is kept.
    config = alice_client.get(url).json()["config"]
    config["headers"]["X-Team"] = "beta"
    changed = alice_client.patch(url, {"config": config}, format="json")
    assert changed.status_code == 200, changed.content
    assert "s3cret" not in changed.content.decode()
    assert stored_headers(environment_id) == {"Authorization": SECRET, "X-Team": "beta"}
    # A config without headers, or a change of another field, keeps them all.
    assert (
        alice_client.patch(url, {"config": {"url": URL, "connect_timeout_s": 5}}, format="json").status_code
        == 200
    )
    assert alice_client.patch(url, {"system_prompt": "Use the tools."}, format="json").status_code == 200
    assert stored_headers(environment_id) == {"Authorization": SECRET, "X-Team": "beta"}
    # A header left out of a given headers object is removed.
    removed = alice_client.patch(
        url, {"config": {"url": URL, "headers": {"Authorization": "********"}}}, format="json"
    )
    assert removed.status_code == 200 and removed.json()["config"]["headers"] == {"Authorization": "********"}
    assert stored_headers(environment_id) == {"Authorization": SECRET}


def test_stored_header_values_are_not_carried_to_another_url(alpha_setup, alice_client, bob_client):
    environment_id = create_with_headers(alice_client, alpha_setup.project.pk).json()["id"]
    url = f"/api/v1/environments/{environment_id}/"
    elsewhere = "http://attacker.example/mcp"
    masked = alice_client.patch(
        url, {"config": {"url": elsewhere, "headers": {"Authorization": "********"}}}, format="json"
    )
    assert masked.status_code == 400 and error_of(masked)["param"] == "config.headers.Authorization"
    omitted = alice_client.patch(url, {"config": {"url": elsewhere}}, format="json")
    assert omitted.status_code == 400 and error_of(omitted)["param"] == "config.headers"
    unknown = alice_client.patch(
        url, {"config": {"url": URL, "headers": {"X-Other": "********"}}}, format="json"
    )
    assert unknown.status_code == 400 and error_of(unknown)["param"] == "config.headers.X-Other"
    assert stored_headers(environment_id) == {"Authorization": SECRET, "X-Team": "alpha"}
    # Given again, the values go to the new URL; a viewer cannot change anything.
    assert bob_client.patch(url, {"config": {"url": URL}}, format="json").status_code == 403
    moved = alice_client.patch(
        url, {"config": {"url": elsewhere, "headers": {"Authorization": "new"}}}, format="json"
    )
    assert moved.status_code == 200 and stored_headers(environment_id) == {"Authorization": "new"}


def test_the_registry_validates_the_plaintext_headers(alpha_setup, alice_client):
    project = alpha_setup.project.pk
    bad = create(alice_client, project, kind="mcp", config={"url": URL, "headers": {"Authorization": 7}})
    assert bad.status_code == 400 and error_of(bad)["param"] == "config.headers"
    smuggled = create(alice_client, project, kind="mcp", config={"url": URL, "headers_encrypted": {"A": "x"}})
    assert smuggled.status_code == 400 and error_of(smuggled)["param"] == "config.headers_encrypted"
    demo = ["python", "-m", "training.environments.mcp_demo.server"]
    stdio = create(alice_client, project, kind="mcp", config={"command": demo, "headers": {"A": "b"}})
    assert stdio.status_code == 400 and error_of(stdio)["param"] == "config.headers"
    assert "only for an HTTP server" in error_of(stdio)["message"]


def test_the_worker_builds_the_environment_with_the_decrypted_headers(alpha_setup, alice_client):
    from projects import services

    environment_id = create_with_headers(alice_client, alpha_setup.project.pk).json()["id"]
    environment = services.environment_build(environment=Environment.objects.get(pk=environment_id))
    try:
        assert environment.config["headers"] == {"Authorization": SECRET, "X-Team": "alpha"}
        assert "headers_encrypted" not in environment.config
    finally:
        environment.close()
