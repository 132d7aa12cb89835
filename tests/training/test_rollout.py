import json

import pytest

from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import EnvironmentSpec, build_messages
from training.rollouts.agent import rollout_group, rollout_groups
from training.rollouts.trajectory import Trajectory, to_train_group


class CountingEngine(TransformersEngine):
    """The real engine, counting its batched calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate_from_tokens(self, prompt_token_ids, sampling, adapter=None):
        self.calls.append(len(prompt_token_ids))
        return super().generate_from_tokens(prompt_token_ids, sampling, adapter)


def test_prompt_row_becomes_a_user_message_after_the_system_prompt():
    env = EnvironmentSpec(system_prompt="Be brief.")
    assert build_messages({"prompt": "Hi", "item": {"answer": "x"}}, env) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert build_messages({"prompt": "Hi"}, EnvironmentSpec()) == [{"role": "user", "content": "Hi"}]


def test_row_system_message_wins_and_the_row_is_not_mutated():
    row = {"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Q"}]}
    messages = build_messages(row, EnvironmentSpec(system_prompt="Env."))
    assert messages == row["messages"]
    messages[0]["content"] = "changed"
    assert row["messages"][0]["content"] == "Own."
    row = {"messages": [{"role": "user", "content": "Q"}]}
    assert build_messages(row, EnvironmentSpec(system_prompt="Env."))[0] == {
        "role": "system",
        "content": "Env.",
    }
    assert len(row["messages"]) == 1


@pytest.mark.parametrize(
    "row", [{}, {"item": {}}, {"prompt": 3}, {"messages": "hi"}, {"messages": [{"content": "x"}]}]
)
def test_malformed_rows_are_rejected(row):
    with pytest.raises(ValueError):
        build_messages(row, EnvironmentSpec())


def test_rollout_group_is_one_batched_call(tiny_model):
    model, tokenizer = tiny_model
    engine = CountingEngine(model, tokenizer)
    env = EnvironmentSpec(system_prompt="You are a helpful assistant.")
    group = rollout_group(
        engine, {"prompt": "Hello!"}, env, SamplingParams(max_new_tokens=6, seed=0), group_size=5
    )
    assert engine.calls == [5]
    assert len(group) == 5
    assert len({tuple(t.completion_token_ids) for t in group}) > 1  # copies are sampled independently
    for trajectory in group:
        assert [m["role"] for m in trajectory.messages] == ["system", "user", "assistant"]
        assert trajectory.output_text == trajectory.messages[-1]["content"]
        assert trajectory.prompt_token_ids == engine.render(trajectory.messages[:-1])
        assert len(trajectory.logprobs) == len(trajectory.completion_token_ids) <= 6
        assert trajectory.finish_reason in ("stop", "length")


def test_rollout_groups_batches_all_rows_and_keeps_their_order(tiny_model):
    model, tokenizer = tiny_model
    engine = CountingEngine(model, tokenizer)
    rows = [{"prompt": "first"}, {"prompt": "second question"}]
    groups = rollout_groups(
        engine, rows, EnvironmentSpec(), SamplingParams(max_new_tokens=4, seed=0), group_size=3
    )
    assert engine.calls == [6]
    assert [g[0].messages[0]["content"] for g in groups] == ["first", "second question"]
    assert all(len(g) == 3 for g in groups)


def test_single_turn_rollouts_mark_every_token_trainable(tiny_model):
    model, tokenizer = tiny_model
    group = rollout_group(
        TransformersEngine(model, tokenizer),
        {"prompt": "Hi"},
        EnvironmentSpec(max_turns=3),  # no tools: the first answer is final whatever max_turns says
        SamplingParams(max_new_tokens=5, seed=1),
        group_size=2,
    )
    for trajectory in group:
        assert trajectory.completion_mask == [1] * len(trajectory.completion_token_ids)
        assert trajectory.metrics == {"turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0}
        assert trajectory.output_tools == []


def test_environment_tools_must_be_tool_objects():
    with pytest.raises(TypeError):
        EnvironmentSpec(tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(ValueError):
        EnvironmentSpec(max_turns=0)


def test_to_train_group_and_to_dict():
    trajectory = Trajectory(
        messages=[{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        reward=0.75,
        sub_rewards={"exact": 1.0},
    )
    group = to_train_group([trajectory])
    (sample,) = group.samples
    assert sample.prompt_token_ids == [1, 2]
    assert sample.completion_token_ids == [3, 4]
    assert sample.completion_logprobs == [-0.5, -0.25]
    assert sample.completion_mask is None
    assert sample.reward == 0.75
    data = json.loads(json.dumps(trajectory.to_dict()))
    assert data["reward"] == 0.75 and data["sub_rewards"] == {"exact": 1.0} and data["errors"] == []
    assert trajectory.output_text == "A"
