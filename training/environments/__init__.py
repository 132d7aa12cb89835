"""Environments: what the model sees around a task row and what answers its turns.

One module per kind (`chat`, `python_tools`, `tic_tac_toe`, `game_2048`, `mcp`, `http_tools`), each a subclass of
`base.Environment`, listed in `registry.ENVIRONMENT_KINDS`; `EnvironmentSpec` builds a tool
environment in Python (tests, benchmarks, scripts). No Django here.

The protocol (message level, so the token-exact agent loop in `training/rollouts/agent.py` and a text-only
OpenAI-compatible client can both drive it):

    environment = build_environment(kind, config=..., tools=..., system_prompt=..., max_turns=...,
                                     tool_timeout_s=...)          # ConfigError(field, message)
    environment.tools                                             # Tool objects shown to the model
    state = environment.start(row, seed=seed)                     # state.messages: the prompt
    reply = environment.respond(state, assistant_text, tool_calls)  # after each model turn
    # reply.messages: tool messages (tool environments) or a user message (games: the board);
    # reply.done: the episode is over (final answer, game over, out of turns)
    environment.outcome(state)                                    # {"result": "win", "reward": 1.0}
    environment.close()                                           # an MCP session; `with` works

Tool calls are parsed from the model's text with `training.rollouts.tools.parse_tool_calls` (Hermes
`<tool_call>` format) when `environment.tools` is not empty, else passed as []. Every kind states
its tools, its default max turns and how the final answer is read (`describe_kinds()`).
"""

from training.environments.base import (
    ConfigError,
    Environment,
    EnvironmentSpec,
    EpisodeState,
    Reply,
    build_messages,
)
from training.environments.mcp import StdioPolicy
from training.environments.registry import (
    ENVIRONMENT_KINDS,
    build_environment,
    describe_kinds,
    get_environment,
    validate_environment,
)

__all__ = [
    "ENVIRONMENT_KINDS",
    "ConfigError",
    "Environment",
    "EnvironmentSpec",
    "EpisodeState",
    "Reply",
    "StdioPolicy",
    "build_environment",
    "build_messages",
    "describe_kinds",
    "get_environment",
    "validate_environment",
]
