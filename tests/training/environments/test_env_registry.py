"""The registry: every kind is listed with its help, validates its settings naming the bad field,
and builds an environment the agent loop can drive."""

import pytest

from training.config import ConfigError
from training.environments import (
    ENVIRONMENT_KINDS,
    StdioPolicy,
    build_environment,
    describe_kinds,
    validate_environment,
)
from training.environments.base import Environment


def test_every_model_kind_has_an_environment_module():
    from projects.models import EnvironmentKind

    assert sorted(ENVIRONMENT_KINDS) == sorted(EnvironmentKind.values)
    assert all(cls.kind == kind and issubclass(cls, Environment) for kind, cls in ENVIRONMENT_KINDS.items())


def test_describe_kinds_states_tools_turns_and_answer():
    kinds = {entry["kind"]: entry for entry in describe_kinds()}
    assert set(kinds) == set(ENVIRONMENT_KINDS)
    assert [tool["name"] for tool in kinds["python_tools"]["available_tools"]] == [
        "calculator", "convert_units", "lookup", "current_time"
    ]  # fmt: skip
    assert kinds["python_tools"]["available_tools"][0]["parameters"]["required"] == ["expression"]
    assert kinds["tic_tac_toe"]["default_max_turns"] == 5
    assert "max_invalid_moves" in kinds["tic_tac_toe"]["config"]
    assert "command" in kinds["mcp"]["config"] and "url" in kinds["mcp"]["config"]
    assert all(entry["answer"] and entry["description"] for entry in kinds.values())


@pytest.mark.parametrize(
    ("kind", "given", "field", "reason"),
    [
        ("poker", {}, "kind", "must be one of chat, python_tools, tic_tac_toe, 2048, mcp"),
        ("chat", {"tools": ["calculator"]}, "tools", "takes no tools"),
        ("chat", {"max_turns": 3}, "max_turns", "exactly one turn"),
        ("chat", {"config": {"x": 1}}, "config.x", "unknown key"),
        ("python_tools", {"tools": ["calculator", "shell"]}, "tools", "unknown tool 'shell'"),
        ("python_tools", {"tools": "calculator"}, "tools", "must be a list of tool names"),
        ("python_tools", {"config": {"now": "yesterday"}}, "config.now", "ISO 8601"),
        ("python_tools", {"max_turns": 0}, "max_turns", "from 1 to 100"),
        ("python_tools", {"tool_timeout_s": 0}, "tool_timeout_s", "greater than 0"),
        ("tic_tac_toe", {"max_turns": 3}, "max_turns", "at least 5"),
        ("tic_tac_toe", {"config": {"model_mark": "Z"}}, "config.model_mark", "one of X, O"),
        ("tic_tac_toe", {"config": {"max_invalid_moves": -1}}, "config.max_invalid_moves", "from 0 to 20"),
        ("tic_tac_toe", {"config": {"max_invalid_moves": 2}, "max_turns": 6}, "max_turns", "at least 7"),
        ("2048", {"config": {"target": 1000}}, "config.target", "power of two"),
        ("2048", {"tools": ["calculator"]}, "tools", "takes no tools"),
        ("mcp", {}, "config", "either config.command"),
        ("mcp", {"config": {"command": ["bash", "-c", "rm -rf /"]}}, "config.command", "demo server"),
        ("mcp", {"config": {"command": "python"}}, "config.command", "non-empty list"),
        ("mcp", {"config": {"url": "ftp://host/mcp"}}, "config.url", "http:// or https://"),
        ("mcp", {"config": {"url": "http://h/mcp", "env": {"A": "1"}}}, "config.env", "only for a stdio"),
        ("mcp", {"config": {"url": "http://h/mcp"}, "tools": [1]}, "tools", "tool names"),
    ],
)
def test_bad_settings_name_the_field(kind, given, field, reason):
    arguments = {"config": {}, "tools": [], "max_turns": None, **given}
    with pytest.raises(ConfigError) as caught:
        validate_environment(kind, **arguments)
    assert caught.value.field == field
    assert reason in caught.value.message


def test_defaults_are_filled_in_per_kind():
    assert validate_environment("chat", config=None, tools=None, max_turns=None) == {
        "config": {}, "tools": [], "max_turns": 1
    }  # fmt: skip
    assert (
        validate_environment("tic_tac_toe", config={"model_mark": "O"}, tools=[], max_turns=None)["max_turns"]
        == 4
    )
    assert validate_environment("2048", config={}, tools=[], max_turns=None)["max_turns"] == 40
    assert validate_environment("python_tools", config={}, tools=["lookup"], max_turns=2)["tools"] == [
        "lookup"
    ]


def test_an_operator_allowed_program_may_run_as_an_mcp_server():
    command = ["/usr/local/bin/weather-mcp", "--stdio"]
    with pytest.raises(ConfigError):
        validate_environment("mcp", config={"command": command}, tools=[], max_turns=None)
    settings = validate_environment(
        "mcp",
        config={"command": command},
        tools=[],
        max_turns=None,
        stdio=StdioPolicy(commands=("/usr/local/bin/weather-mcp --stdio",)),
    )
    assert settings["config"]["command"] == command


def test_build_environment_gives_each_kind_its_tools():
    assert build_environment("chat").tools == []
    tools = build_environment("python_tools", tools=["lookup", "calculator"]).tools
    assert [tool.name for tool in tools] == ["lookup", "calculator"]
    assert [tool.name for tool in build_environment("python_tools").tools] == [
        "calculator", "convert_units", "lookup", "current_time"
    ]  # fmt: skip
    game = build_environment("tic_tac_toe", system_prompt="Play well.")
    assert game.tools == [] and game.max_turns == 5 and game.system_prompt == "Play well."
