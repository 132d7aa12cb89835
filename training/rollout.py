"""Rollouts: task rows in, trajectories (messages, exact tokens, a trainable-token mask) out.

The data types live here; the multi-turn agent loop that fills them is `training/agent.py`, and
what answers the model's turns (tool results, a game's board) is an environment from
`training/environments`. A single-turn rollout is the agent loop with one turn and no tools: one
code path for both.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from training.engines.base import Engine, SamplingParams
from training.environments.base import Environment, build_messages, check_common
from training.tools import Tool
from training.trainer import TrainGroup, TrainSample

# build_messages lives with the environments (their `start` uses it); re-exported for callers.
__all__ = [
    "EnvironmentSpec",
    "Trajectory",
    "build_messages",
    "rollout_group",
    "rollout_groups",
    "to_train_group",
]


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


@dataclass
class Trajectory:
    """One episode: the conversation, the exact tokens, and what the graders said.

    Tokens: `prompt_token_ids` is the rendered first prompt; `completion_token_ids` is everything
    after it, each model turn's sampled ids (mask 1) followed by the environment's ids between
    turns (tool results and the next assistant header; mask 0). `logprobs` is aligned with it: the
    sampler's logprob on sampled ids, 0.0 on environment ids. The trainer trains on mask-1 ids only.
    """

    messages: list[dict]  # OpenAI-style: system/user, then assistant (with tool_calls) and tool turns
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # the last turn's "stop" or "length"; "max_turns" if it still called tools
    completion_mask: list[int] | None = None  # 1 = sampled by the model; None = all of them
    reward: float = 0.0
    sub_rewards: dict = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)  # grader errors are data, not crashes
    metrics: dict = field(default_factory=dict)  # turns, tool_calls, tool_errors, tool_timeouts, ...
    outcome: dict = field(default_factory=dict)  # the environment's verdict: {"result": "win", ...}

    @property
    def output_text(self) -> str:
        """The model's final answer: the content of the last assistant message."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return message.get("content") or ""
        return ""

    @property
    def output_tools(self) -> list[dict[str, Any]]:
        """Every tool call the model made, in order, as `{name, arguments}` (arguments parsed)."""
        calls = []
        for message in self.messages:
            for call in message.get("tool_calls") or []:
                function = call["function"]
                try:
                    arguments = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    arguments = function["arguments"]  # what the model wrote, unparseable
                calls.append({"name": function["name"], "arguments": arguments})
        return calls

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rollout_groups(
    engine: Engine,
    rows: list[dict],
    env: Environment,
    sampling: SamplingParams,
    group_size: int,
    adapter: str | None = None,
) -> list[list[Trajectory]]:
    """`group_size` trajectories for each row, in row order; one batched engine call per turn."""
    # agent.py builds on this module's types, so it is imported here rather than at the top.
    from training.agent import run_agent_groups

    return run_agent_groups(engine, rows, env, sampling, group_size, adapter=adapter)


def rollout_group(
    engine: Engine,
    row: dict,
    env: Environment,
    sampling: SamplingParams,
    group_size: int,
    adapter: str | None = None,
) -> list[Trajectory]:
    """`group_size` trajectories for one row."""
    return rollout_groups(engine, [row], env, sampling, group_size, adapter=adapter)[0]


def to_train_group(trajectories: list[Trajectory]) -> TrainGroup:
    """The trainer's view of a graded group: tokens, sampler logprobs, trainable mask, reward."""
    return TrainGroup(
        samples=[
            TrainSample(
                prompt_token_ids=list(t.prompt_token_ids),
                completion_token_ids=list(t.completion_token_ids),
                completion_logprobs=list(t.logprobs),
                reward=float(t.reward),
                completion_mask=None if t.completion_mask is None else list(t.completion_mask),
            )
            for t in trajectories
        ]
    )
