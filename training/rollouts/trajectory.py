"""The data an episode leaves behind, and the trainer's view of it: plain dataclasses, no torch.

`Trajectory` is what the agent loop (`training/rollouts/agent.py`) and a remote policy
(`training/rollouts/remote.py`) produce and what graders, storage and the viewer read; `TrainGroup` /
`TrainSample` are what `training.recipes.grpo_update.grpo_train_step` takes. This module imports nothing
heavy, so the web process (evaluations, scenario generation) can hold trajectories without
loading torch or peft.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from training.rollouts.strict_json import loads_lenient

__all__ = ["TrainGroup", "TrainSample", "Trajectory", "longest_turn", "overlong_penalty", "to_train_group"]


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
                    arguments = loads_lenient(function["arguments"])
                except json.JSONDecodeError:
                    arguments = function["arguments"]  # what the model wrote, unparseable
                calls.append({"name": function["name"], "arguments": arguments})
        return calls

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class TrainSample:
    """One trajectory: its prompt, then exactly the tokens that followed, their sampler logprobs,
    its reward. In a multi-turn trajectory the completion also holds the environment's tokens
    (tool results, chat headers); `completion_mask` marks which ones the model sampled (1). Only
    those are trained on and counted; None means all of them.
    """

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]  # aligned with completion_token_ids; ignored where the mask is 0
    reward: float
    completion_mask: list[int] | None = None

    def trainable_tokens(self) -> int:
        mask = self.completion_mask
        return len(self.completion_token_ids) if mask is None else sum(mask)


@dataclass
class TrainGroup:
    """The completions of one task row; advantages are computed within it."""

    samples: list[TrainSample]


def to_train_group(
    trajectories: list[Trajectory], *, overlong_filter: bool = False, max_new_tokens: int = 0,
    length_penalty_buffer: int = 0,
) -> TrainGroup:  # fmt: skip
    """The trainer's view of a graded group: tokens, sampler logprobs, trainable mask, reward.

    ``overlong_filter``: a trajectory whose last turn was cut off at the token limit (finish reason
    ``length``) keeps its reward but gets an all-0 mask, so it is not trained on. ``length_penalty_buffer``
    (with ``max_new_tokens``): DAPO's soft overlong penalty added to the reward (``overlong_penalty``).
    """
    samples = []
    for t in trajectories:
        mask = None if t.completion_mask is None else list(t.completion_mask)
        if overlong_filter and t.finish_reason == "length":
            mask = [0] * len(t.completion_token_ids)
        penalty = overlong_penalty(longest_turn(t), max_new_tokens, length_penalty_buffer)
        samples.append(
            TrainSample(
                prompt_token_ids=list(t.prompt_token_ids),
                completion_token_ids=list(t.completion_token_ids),
                completion_logprobs=list(t.logprobs),
                reward=float(t.reward) + penalty,
                completion_mask=mask,
            )
        )
    return TrainGroup(samples=samples)


def longest_turn(trajectory: Trajectory) -> int:
    """The most tokens the model sampled in one turn (a run of 1s in the completion mask)."""
    mask = trajectory.completion_mask
    if mask is None:
        return len(trajectory.completion_token_ids)
    longest = run = 0
    for bit in mask:
        run = run + 1 if bit else 0
        longest = max(longest, run)
    return longest


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer`` tokens, then falling
    linearly to -1 at ``max_tokens`` (and -1 beyond); 0 when ``buffer`` is 0 (off)."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    return -min(1.0, (length - (max_tokens - buffer)) / buffer)
