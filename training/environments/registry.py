"""The environment registry: one module per kind, listed here in one readable dict.

settings = validate_environment("tic_tac_toe", config={}, tools=[], max_turns=None)  # ConfigError
environment = build_environment("python_tools", config={}, tools=["calculator"],
                                system_prompt="", max_turns=4, tool_timeout_s=10.0)
"""

from __future__ import annotations

from typing import Any

from training.config import ConfigError
from training.environments.base import Environment
from training.environments.chat import ChatEnvironment
from training.environments.game_2048 import Game2048Environment
from training.environments.http_tools import HttpToolsEnvironment
from training.environments.mcp import MCPEnvironment, StdioPolicy
from training.environments.python_tools import PythonToolsEnvironment
from training.environments.tic_tac_toe import TicTacToeEnvironment
from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy

ENVIRONMENT_KINDS: dict[str, type[Environment]] = {
    ChatEnvironment.kind: ChatEnvironment,
    PythonToolsEnvironment.kind: PythonToolsEnvironment,
    TicTacToeEnvironment.kind: TicTacToeEnvironment,
    Game2048Environment.kind: Game2048Environment,
    MCPEnvironment.kind: MCPEnvironment,
    HttpToolsEnvironment.kind: HttpToolsEnvironment,
}


def get_environment(kind: str) -> type[Environment]:
    if kind not in ENVIRONMENT_KINDS:
        raise ConfigError("kind", f"must be one of {', '.join(ENVIRONMENT_KINDS)}")
    return ENVIRONMENT_KINDS[kind]


def validate_environment(
    kind: str,
    *,
    config: Any,
    tools: Any,
    max_turns: int | None,
    tool_timeout_s: float = 10.0,
    stdio: StdioPolicy | None = None,
) -> dict[str, Any]:
    """`{"config", "tools", "max_turns"}` normalised for `kind` (defaults filled in), or ConfigError
    naming the field. Connects to nothing (an MCP server is only reached when a run starts).
    `stdio`: the operator's rules for MCP stdio servers (which commands, which env names)."""
    if (
        isinstance(tool_timeout_s, bool)
        or not isinstance(tool_timeout_s, int | float)
        or not 0 < tool_timeout_s <= 600
    ):
        raise ConfigError("tool_timeout_s", "must be a number of seconds greater than 0, at most 600")
    environment = get_environment(kind)
    if environment is MCPEnvironment:
        return MCPEnvironment.validate(config, tools, max_turns, stdio=stdio)
    return environment.validate(config, tools, max_turns)


def build_environment(
    kind: str,
    *,
    config: Any = None,
    tools: Any = None,
    system_prompt: str = "",
    max_turns: int | None = None,
    tool_timeout_s: float = 10.0,
    stdio: StdioPolicy | None = None,
    outbound: OutboundPolicy = PUBLIC_ONLY,
) -> Environment:
    """A ready environment of `kind` (validated first). Close it when done (`with` works).
    `outbound`: which hosts an MCP server URL or an http_tools endpoint may reach (``training.safety.outbound``); `stdio`: how an
    MCP stdio server is allowed and confined."""
    settings = validate_environment(
        kind,
        config=config,
        tools=tools,
        max_turns=max_turns,
        tool_timeout_s=tool_timeout_s,
        stdio=stdio,
    )
    return get_environment(kind).from_settings(
        config=settings["config"],
        tools=settings["tools"],
        system_prompt=system_prompt,
        max_turns=settings["max_turns"],
        tool_timeout_s=float(tool_timeout_s),
        **({"outbound": outbound, "stdio": stdio} if kind == MCPEnvironment.kind else {}),
        **({"outbound": outbound} if kind == HttpToolsEnvironment.kind else {}),
    )


def describe_kinds() -> list[dict[str, Any]]:
    """Every kind with its help, for the API and the dashboard."""
    return [
        {
            "kind": kind,
            "description": environment.description,
            "answer": environment.answer,
            "default_max_turns": environment.default_max_turns,
            "config": dict(environment.config_help),
            "tools": environment.tools_help,
            "available_tools": environment.available_tools(),
        }
        for kind, environment in ENVIRONMENT_KINDS.items()
    ]
