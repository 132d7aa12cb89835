"""Environments through the API: per-kind validation by the registry (400 naming the field), kind
changes taking the new kind's defaults, and the environment-kinds help for the dashboard."""

import pytest

from projects.models import Environment


def error_of(response) -> dict:
    body = response.json()
    assert "error" in body, body
    return body["error"]


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
    kinds = {entry["kind"]: entry for entry in response.json()}
    assert list(kinds) == ["chat", "python_tools", "tic_tac_toe", "2048", "mcp"]
    assert [tool["name"] for tool in kinds["python_tools"]["available_tools"]] == [
        "calculator", "convert_units", "lookup", "current_time"
    ]  # fmt: skip
    assert "lookup_field" in kinds["python_tools"]["config"]
    assert kinds["2048"]["default_max_turns"] == 40 and "target" in kinds["2048"]["config"]
    assert "<move>" in kinds["tic_tac_toe"]["answer"]
    assert anonymous_client.get("/api/v1/environment-kinds").status_code in (401, 403)
