"""Rollouts: task rows in, trajectories (messages, exact tokens, logprobs) out.

Single-turn for now: one model turn per trajectory. The multi-turn agent loop (tool calls, tool
results, up to `max_turns`) will build on the same Trajectory, with a token mask over the
model-generated spans.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from training.engines.base import Engine, SamplingParams
from training.trainer import TrainGroup, TrainSample


@dataclass
class EnvironmentSpec:
    """What the model sees around a task row."""

    system_prompt: str = ""  # prepended unless the row brings its own system message
    max_turns: int = 1
    tools: list = field(default_factory=list)


@dataclass
class Trajectory:
    """One episode: the conversation, the exact sampled tokens, and what the graders said."""

    messages: list[dict]  # OpenAI-style, system/user/assistant, ending with the model's answer
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reward: float = 0.0
    sub_rewards: dict = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)  # grader/tool errors are data, not crashes
    metrics: dict = field(default_factory=dict)

    @property
    def output_text(self) -> str:
        """The model's final answer: the content of the last assistant message."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return message.get("content") or ""
        return ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_messages(row: dict, env: EnvironmentSpec) -> list[dict]:
    """The prompt messages of a task row: `{"messages": [...]}` or `{"prompt": "..."}` (+ "item")."""
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
    if env.system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": env.system_prompt})
    return messages


def rollout_groups(
    engine: Engine,
    rows: list[dict],
    env: EnvironmentSpec,
    sampling: SamplingParams,
    group_size: int,
    adapter: str | None = None,
) -> list[list[Trajectory]]:
    """`group_size` trajectories for each row, from ONE batched engine.generate call."""
    if env.tools:
        raise NotImplementedError("tools need the multi-turn agent loop, which is not built yet")
    prompts = [build_messages(row, env) for row in rows]
    requests = [prompt for prompt in prompts for _ in range(group_size)]
    choices = engine.generate(requests, sampling, adapter=adapter)
    groups: list[list[Trajectory]] = []
    for index, prompt in enumerate(prompts):
        group = []
        for choice in choices[index * group_size : (index + 1) * group_size]:
            group.append(
                Trajectory(
                    messages=[*copy.deepcopy(prompt), {"role": "assistant", "content": choice.text}],
                    prompt_token_ids=choice.prompt_token_ids,
                    completion_token_ids=choice.token_ids,
                    logprobs=choice.logprobs,
                    finish_reason=choice.finish_reason,
                )
            )
        groups.append(group)
    return groups


def rollout_group(
    engine: Engine,
    row: dict,
    env: EnvironmentSpec,
    sampling: SamplingParams,
    group_size: int,
    adapter: str | None = None,
) -> list[Trajectory]:
    """`group_size` trajectories for one row, from one batched engine.generate call."""
    return rollout_groups(engine, [row], env, sampling, group_size, adapter=adapter)[0]


def to_train_group(trajectories: list[Trajectory]) -> TrainGroup:
    """The trainer's view of a graded group: tokens, sampler logprobs, reward."""
    return TrainGroup(
        samples=[
            TrainSample(
                prompt_token_ids=list(t.prompt_token_ids),
                completion_token_ids=list(t.completion_token_ids),
                completion_logprobs=list(t.logprobs),
                reward=float(t.reward),
            )
            for t in trajectories
        ]
    )
