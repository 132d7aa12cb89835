"""What a step records with each trajectory (length penalty, advantage, trained) is what its GRPO
update trained on: the viewer and the API show these values instead of recomputing them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from training.config import TrainConfig
from training.recipes import grpo_update
from training.recipes.grpo import update_advantages
from training.recipes.grpo_update import grpo_step
from training.rollouts.trajectory import Trajectory
from training.runs.steps import DrawnStep, update_step


def answer(reward: float, tokens: int, finish: str = "stop") -> Trajectory:
    return Trajectory(messages=[], prompt_token_ids=[1, 2], completion_token_ids=list(range(tokens)),
                      logprobs=[-1.0] * tokens, finish_reason=finish, reward=reward)  # fmt: skip


class CapturingRun:
    """Runs the real grpo_step and keeps the (sample, advantage) pairs it hands to the update."""

    def __init__(self, config: TrainConfig) -> None:
        self.config, self.trained = config, []

    def train_step(self, groups, *, learning_rate=None):
        return grpo_step(lambda metrics: None, groups, self.config, step=1, learning_rate=learning_rate)

    def save_checkpoint(self, path, *, step, metrics):
        path.mkdir(parents=True)


def test_each_trajectory_records_the_advantage_and_length_penalty_its_update_used(tmp_path, monkeypatch):
    # The demo's penalty: 1/16 of a reward per token. Group 0 differs in the grader's reward but not
    # after the penalty (a right answer in 12 tokens against a half-right one in 4): the update
    # trains nothing on it, where the rewards alone give advantages of ±1.
    config = TrainConfig(group_size=4, groups_per_step=3, max_new_tokens=16, length_penalty_buffer=16,
                         overlong_filter=True, learning_rate=1e-3)  # fmt: skip
    flat = [answer(1.0, 12), answer(0.5, 4), answer(1.0, 12), answer(0.5, 4)]
    mixed = [answer(1.0, 1), answer(0.0, 3), answer(0.0, 16, "length"), answer(1.0, 2)]
    dropped = [answer(0.0, 2) for _ in range(4)]  # drawn, not in the batch
    captured: list = []

    def update_samples(session_for, samples, metrics, config, **kwargs):
        captured.extend(samples)
        return metrics

    monkeypatch.setattr(grpo_update, "update_samples", update_samples)
    spec = SimpleNamespace(config=config, start_step=0, checkpoint_root=tmp_path)
    drawn = DrawnStep(1, "step 1", None, [flat, mixed, dropped], [{}, {}, {}], {}, [flat, mixed], 0)  # type: ignore[arg-type]
    update_step(spec, CapturingRun(config), None, drawn, on_restart=lambda _: None)  # type: ignore[arg-type]

    assert [t.metrics["length_penalty"] for t in flat] == [-0.75, -0.25, -0.75, -0.25]
    assert [(t.metrics["advantage"], t.metrics["trained"]) for t in flat] == [(0.0, False)] * 4
    assert [(t.metrics["advantage"], t.metrics["trained"]) for t in dropped] == [(0.0, False)] * 4
    # The cut-off answer counts in the group's mean but is not trained on (overlong_filter).
    assert [t.metrics["trained"] for t in mixed] == [True, True, False, True]
    trained = [t for group in (flat, mixed) for t in group if t.metrics["trained"]]
    assert len(captured) == len(trained) == 3
    for (sample, advantage), trajectory in zip(captured, trained, strict=True):
        assert sample.completion_token_ids == trajectory.completion_token_ids
        assert trajectory.metrics["advantage"] == advantage  # exactly, not approximately
        assert sample.reward == trajectory.reward + trajectory.metrics["length_penalty"]
    assert mixed[0].metrics["advantage"] > 0 > mixed[1].metrics["advantage"]


def test_update_advantages_leaves_out_flat_groups_and_untrainable_samples():
    assert update_advantages([0.25, 0.25], [True, True], scale=True) == [None, None]
    kept = update_advantages([1.0, 0.0, 0.0], [True, True, False], scale=False)
    assert kept[2] is None and kept[:2] == pytest.approx([2 / 3, -1 / 3])
