"""The environment protocol the agent loop drives, and the tool environment every kind builds on.

One episode, message by message (all the loop needs, and all a text-only OpenAI-compatible client
needs to drive the same environment remotely):

    state = environment.start(row, seed=seed)      # state.messages: the prompt messages
    # model turn -> assistant text (+ the tool calls parsed from it, [] for environments without tools)
    reply = environment.respond(state, text, calls)  # reply.messages: tool or user messages; reply.done
    ...                                              # until reply.done or max_turns model turns
    environment.outcome(state)                       # e.g. {"result": "win", "reward": 1.0}

`respond_batch` answers many episodes' turns at once (the lockstep loop uses it; tool environments
start every tool call of the turn together, so a turn waits for its slowest tool, not the sum).
The environment never sees tokens: `training/rollouts/agent.py` renders the reply messages into the ids
between two model turns (mask 0) and keeps the model's sampled ids as they were.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

from training.config import ConfigError
from training.rollouts.tools import Tool, ToolCall, ToolResult, run_tool_call_batches

__all__ = ["ConfigError", "Environment", "EnvironmentSpec", "EpisodeState", "Reply", "build_messages"]


@dataclass
class EpisodeState:
    """One episode as the environment tracks it. `data` is the kind's own (a board, a row's item);
    `metrics` are counters copied into the trajectory's metrics."""

    messages: list[dict[str, Any]]  # the prompt messages the first model turn answers
    row: dict[str, Any]
    seed: int | None = None
    turn: int = 0  # model turns answered so far (respond_batch counts them)
    done: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=lambda: {"tool_errors": 0, "tool_timeouts": 0})
    tools: list[Tool] = field(default_factory=list)  # the tools this episode's calls run with

    @property
    def rng(self) -> random.Random:
        """The episode's random numbers (opponent moves, new tiles): seeded, so replays repeat."""
        if "rng" not in self.data:
            self.data["rng"] = random.Random(self.seed)
        rng: random.Random = self.data["rng"]
        return rng


@dataclass
class Reply:
    """The environment's answer to one model turn."""

    messages: list[dict[str, Any]]  # tool (or user) messages the model reads next; [] when done
    done: bool = False
    # Why the episode ended, when the environment (not the model) ended it: "max_turns" for a model
    # still calling tools on its last turn. None: the model's own finish reason ("stop"/"length").
    finish_reason: str | None = None


# How a tool-calling kind's final answer is read (`answer`), for the kinds' descriptions.
TOOL_CALLING_ANSWER = "the last assistant message without a tool call (output_text); calls in output_tools"


class Environment:
    """Base class of every kind: a tool environment (tools run, a turn without a call ends the
    episode). Kinds override `start`, `reply` and `outcome`, and declare their config in `validate`.

    Class attributes document the kind for the API (`GET /api/v1/environment-kinds`).
    """

    kind: ClassVar[str] = "tools"
    description: ClassVar[str] = "The model may call tools; a turn without a tool call is its final answer."
    answer: ClassVar[str] = "the content of the last assistant message (output_text)"
    default_max_turns: ClassVar[int] = 1
    config_help: ClassVar[dict[str, str]] = {}
    tools_help: ClassVar[str] = "no tools"

    system_prompt: str
    max_turns: int
    tools: list[Tool]
    tool_timeout_s: float
    config: dict[str, Any]

    def __init__(
        self,
        *,
        system_prompt: str = "",
        max_turns: int = 1,
        tools: list[Tool] | None = None,
        tool_timeout_s: float = 10.0,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        tool_list = list(tools or [])
        check_common(max_turns=max_turns, tool_timeout_s=tool_timeout_s, tools=tool_list)
        self.tools = tool_list  # shown to the model; their functions may be rebound per episode
        self.tool_timeout_s = tool_timeout_s
        self.config = dict(config or {})

    # ------------------------------------------------------------------ what the kind declares

    @classmethod
    def validate(cls, config: Any, tools: Any, max_turns: int | None) -> dict[str, Any]:
        """The kind's settings normalised (`{"config", "tools", "max_turns"}`, defaults filled in),
        or ConfigError naming the first bad field (`config.<key>`, `tools`, `max_turns`)."""
        config = _object(config, "config")
        if config:
            raise ConfigError(f"config.{next(iter(config))}", f"unknown key ({cls.kind} takes no config)")
        if tools not in (None, []):
            raise ConfigError("tools", f"a {cls.kind} environment takes no tools")
        return {"config": {}, "tools": [], "max_turns": _turns(max_turns, cls.default_max_turns)}

    @classmethod
    def from_settings(
        cls,
        *,
        config: dict[str, Any],
        tools: list[Any],
        system_prompt: str,
        max_turns: int,
        tool_timeout_s: float,
        **options: Any,
    ) -> Environment:
        """The environment from settings `validate` normalised; the kind's `tools` setting reaches
        its constructor through `tool_arguments`, a kind's own `options` (mcp: `outbound`) as given."""
        return cls(
            system_prompt=system_prompt,
            max_turns=max_turns,
            tool_timeout_s=tool_timeout_s,
            config=config,
            **cls.tool_arguments(tools, config),
            **options,
        )

    @classmethod
    def tool_arguments(cls, tools: list[Any], config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments for the normalised `tools` setting: none for a kind without tools;
        a kind with tools builds them here."""
        return {}

    @classmethod
    def available_tools(cls) -> list[dict[str, Any]]:
        """The tools a user may enable, as OpenAI function definitions (for the API's help)."""
        return []

    def close(self) -> None:
        """Release what the environment holds (an MCP session); idempotent."""

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the protocol

    def start(self, row: dict[str, Any], *, seed: int | None = None) -> EpisodeState:
        return EpisodeState(messages=build_messages(row, self), row=row, seed=seed, tools=list(self.tools))

    def respond(self, state: EpisodeState, text: str, calls: list[ToolCall]) -> Reply:
        return self.respond_batch([state], [text], [calls])[0]

    def respond_batch(
        self, states: list[EpisodeState], texts: list[str], calls: list[list[ToolCall]]
    ) -> list[Reply]:
        for state in states:
            state.turn += 1
        replies = []
        for state, reply in zip(states, self.reply_batch(states, texts, calls), strict=True):
            if not reply.done and state.turn >= self.max_turns:  # the episode is out of turns
                reply = Reply([], done=True, finish_reason="max_turns")
            if not reply.done and not reply.messages:
                raise RuntimeError(f"{self.kind} environment went on without a message for the model")
            state.done = reply.done
            replies.append(reply)
        return replies

    def reply_batch(
        self, states: list[EpisodeState], texts: list[str], calls: list[list[ToolCall]]
    ) -> list[Reply]:
        """Tool behaviour: run every episode's calls together (one deadline for all of them)."""
        replies: list[Reply | None] = [None] * len(states)
        batches: list[tuple[int, list[ToolCall]]] = []
        for index, (state, episode_calls) in enumerate(zip(states, calls, strict=True)):
            if not episode_calls:
                replies[index] = Reply([], done=True)
            elif state.turn >= self.max_turns:  # no turn is left to read their results: not run
                replies[index] = Reply([], done=True, finish_reason="max_turns")
            else:
                batches.append((index, episode_calls))
        results = self.run_calls([(states[index], episode_calls) for index, episode_calls in batches])
        for (index, episode_calls), episode_results in zip(batches, results, strict=True):
            count_tool_results(states[index], episode_results)
            replies[index] = Reply(
                [
                    tool_message(call, result)
                    for call, result in zip(episode_calls, episode_results, strict=True)
                ]
            )
        return [reply for reply in replies if reply is not None]

    def run_calls(self, batches: list[tuple[EpisodeState, list[ToolCall]]]) -> list[list[ToolResult]]:
        """One result per call of each episode: all start at once and share one deadline. A kind
        whose calls need their episode and call id (http_tools: the rollout id) overrides it."""
        return run_tool_call_batches([(calls, state.tools) for state, calls in batches], self.tool_timeout_s)

    def outcome(self, state: EpisodeState) -> dict[str, Any]:
        """What the episode achieved, for graders (`sample.outcome`) and the viewer."""
        return {}


@dataclass(eq=False)
class EnvironmentSpec(Environment):
    """A tool environment built in Python (tests, benchmarks, scripts): the given tools, the agent
    loop's default behaviour. Runs build theirs from the registry (`training.environments`)."""

    system_prompt: str = ""  # prepended unless the row brings its own system message
    max_turns: int = 1  # model turns per trajectory; a turn without a tool call ends it earlier
    tools: list[Tool] = field(default_factory=list)
    tool_timeout_s: float = 10.0  # a tool call still running after this is abandoned (an error)
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_common(max_turns=self.max_turns, tool_timeout_s=self.tool_timeout_s, tools=self.tools)


def tool_message(call: ToolCall, result: ToolResult) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": result.content}


def count_tool_results(state: EpisodeState, results: list[ToolResult]) -> None:
    state.metrics["tool_timeouts"] += sum(result.timed_out for result in results)
    state.metrics["tool_errors"] += sum(
        result.error is not None and not result.timed_out for result in results
    )


def build_messages(row: dict, env: Any) -> list[dict]:
    """The prompt messages of a task row: `{"messages": [...]}` or `{"prompt": "..."}` (+ "item"),
    with `env.system_prompt` first unless the row brings its own system message."""
    return prompt_messages(row, env.system_prompt)


def prompt_messages(row: dict, system_prompt: str) -> list[dict]:
    """`build_messages` with the system prompt given as a string."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("row 'messages' must be a list of {role, content} objects")
        messages = copy.deepcopy(messages)  # trajectories must not alias the task row
    elif "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError("row 'prompt' must be a string")
        messages = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ValueError("a task row needs 'messages' or 'prompt'")
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def game_start(row: dict[str, Any], *, seed: int | None, system_prompt: str) -> EpisodeState:
    """A game's first state, before its board is shown: the row's `item.seed` overrides the
    rollout's seed; the messages are the row's prompt (with `system_prompt` unless it brings its
    own), or none for a row that has only an item."""
    item = _item(row)
    if isinstance(item.get("seed"), int):
        seed = item["seed"]
    messages = prompt_messages(row, system_prompt) if ("prompt" in row or "messages" in row) else []
    return EpisodeState(messages=messages, row=row, seed=seed)


def show_board(state: EpisodeState, text: str, *, system_prompt: str) -> None:
    """Show a game's opening `text` (its board): after the row's last user message, or as the
    first user message, after `system_prompt` when the row gave no messages at all."""
    messages = state.messages
    if messages and messages[-1]["role"] == "user":
        messages[-1]["content"] = f"{messages[-1].get('content') or ''}\n\n{text}".lstrip()
    else:
        if not messages:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": text})


def check_common(*, max_turns: int, tool_timeout_s: float, tools: list[Tool]) -> None:
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError("max_turns", "must be at least 1")
    if not tool_timeout_s > 0:
        raise ConfigError("tool_timeout_s", "must be greater than 0")
    if not all(isinstance(tool, Tool) for tool in tools):
        raise TypeError("environment tools must be training.rollouts.tools.Tool objects (with a function)")
    if len({tool.name for tool in tools}) != len(tools):
        raise ConfigError("tools", "tool names must be unique")


# ---------------------------------------------------------------------- config helpers for kinds


def _item(row: dict[str, Any]) -> dict[str, Any]:
    item = row.get("item")
    return item if isinstance(item, dict) else {}


def _object(value: Any, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(name, "must be an object")
    return dict(value)


def _turns(max_turns: int | None, default: int, minimum: int = 1, maximum: int = 100) -> int:
    if max_turns is None:
        return default
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or not minimum <= max_turns <= maximum:
        raise ConfigError("max_turns", f"must be an integer from {minimum} to {maximum}")
    return max_turns


def known_keys(config: dict[str, Any], allowed: dict[str, str]) -> None:
    for key in config:
        if key not in allowed:
            raise ConfigError(
                f"config.{key}", f"unknown key (allowed: {', '.join(sorted(allowed)) or 'none'})"
            )


def number(config: dict[str, Any], key: str, default: float, *, minimum: float | None = None) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(f"config.{key}", "must be a number")
    if minimum is not None and value < minimum:
        raise ConfigError(f"config.{key}", f"must be at least {minimum:g}")
    return float(value)


def integer(config: dict[str, Any], key: str, default: int, *, minimum: int, maximum: int) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ConfigError(f"config.{key}", f"must be an integer from {minimum} to {maximum}")
    return value


def choice(config: dict[str, Any], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = config.get(key, default)
    if value not in choices:
        raise ConfigError(f"config.{key}", f"must be one of {', '.join(choices)}")
    return str(value)
