"""Rollouts that overlap training (issue 28, item 3: ``max_off_policy_steps``; training.runs.overlap)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import training.runs.steps as run_steps
from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_learning_signal import ROWS
from training.config import ConfigError, LoraSpec, TrainConfig
from training.environments import build_environment
from training.hosting.in_process import InProcessRun
from training.runs.loop import run_training
from training.runs.overlap import policy_step_for
from training.runs.spec import RunSpec
from training.runs.steps import checkpoint_path
from training.session.checkpoint_files import ADAPTER_WEIGHTS

# Matches some of what the tiny random model writes: groups carry a signal, so updates move weights.
GRADER = {"type": "regex", "name": "vowel", "pattern": "[aeiou]"}


def spec(tiny_model_dir, root, *, steps: int = 4, resume_step: int | None = None, **config: Any) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=root,
        config=TrainConfig(
            **{
                "steps": steps,
                "group_size": 4,
                "groups_per_step": 2,
                "max_new_tokens": 6,
                "learning_rate": 5e-2,
                "eval_max_rows": 1,
                **config,
            }
        ),  # fmt: skip
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec=GRADER,
        train_rows=ROWS,
        validation_rows=ROWS[:1],
        start_step=0,
        resume_step=resume_step,
    )


def test_the_policy_a_step_samples_is_never_more_than_the_lag_behind():
    assert [policy_step_for(s, lag=1, first=0) for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [policy_step_for(s, lag=2, first=0) for s in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    # A fork (or a continued model) starts at its own first checkpoint: never before it.
    assert [policy_step_for(s, lag=2, first=5) for s in (6, 7, 8, 9)] == [5, 5, 5, 6]
    assert [policy_step_for(s, lag=0, first=0) for s in (1, 2, 3)] == [0, 1, 2]
    with pytest.raises(ConfigError) as caught:
        TrainConfig(max_off_policy_steps=17)
    assert caught.value.field == "max_off_policy_steps"
    with pytest.raises(ConfigError) as caught:
        TrainConfig(max_off_policy_steps=1).check_objective("sft")
    assert caught.value.field == "max_off_policy_steps"


def test_an_overlapped_run_records_every_step_in_order_with_its_staleness(tiny_model_dir, tmp_path):
    hooks = MeteredHooks()
    assert run_training(spec(tiny_model_dir, tmp_path, max_off_policy_steps=1), hooks) == "succeeded"
    assert hooks.steps == [1, 2, 3, 4]
    assert [m["off_policy_steps"] for m in hooks.metrics] == [0.0, 1.0, 1.0, 1.0]
    for step, metrics in enumerate(hooks.metrics, start=1):
        policy = {t.metrics["policy_step"] for t in metrics["trajectories"]}
        staleness = {t.metrics["off_policy_steps"] for t in metrics["trajectories"]}
        assert policy == {max(0, step - 2)} and staleness == {step - 1 - max(0, step - 2)}
        # Every checkpoint the sampler took was the trainer's at the moment it was saved.
        assert metrics["sampler_logprob_gap"] <= 1e-4
        assert metrics["step_seconds"] > 0 and metrics["update_wait_seconds"] >= 0
        assert (tmp_path / f"step-{step:06d}" / "adapter_model.safetensors").is_file()
    assert any(m["trainable_tokens"] > 0 for m in hooks.metrics), "no update moved the policy"
    # Evaluated at the start and at the last step, as a synchronous run is.
    assert len(hooks.evaluations) == 2


def test_the_lag_bounds_how_old_the_samples_are(tiny_model_dir, tmp_path):
    hooks = MeteredHooks()
    assert run_training(spec(tiny_model_dir, tmp_path, steps=4, max_off_policy_steps=2), hooks) == "succeeded"
    assert [m["off_policy_steps"] for m in hooks.metrics] == [0.0, 1.0, 2.0, 2.0]
    assert [m["trajectories"][0].metrics["policy_step"] for m in hooks.metrics] == [0, 0, 0, 1]


def test_rollouts_of_the_next_step_run_while_the_update_runs(tiny_model_dir, tmp_path, monkeypatch):
    # The update of step 1 waits until the rollouts of step 2 have begun: a loop that takes turns
    # would never get there (the wait times out and the test fails).
    rollouts_began: dict[int, threading.Event] = {step: threading.Event() for step in range(1, 4)}
    overlapped: list[bool] = []
    real_rollouts, real_train_step = run_steps.rollout_groups, InProcessRun.train_step

    def rollouts(*args, **kwargs):  # called once per step (no dynamic sampling), in step order
        started = [event for event in rollouts_began.values() if not event.is_set()]
        started[0].set()
        return real_rollouts(*args, **kwargs)

    def train_step(self, groups, **kwargs):
        if self.step + 1 < 3:  # the updates of steps 1 and 2 wait for the next step's rollouts
            overlapped.append(rollouts_began[self.step + 2].wait(timeout=60))
        return real_train_step(self, groups, **kwargs)

    monkeypatch.setattr(run_steps, "rollout_groups", rollouts)
    monkeypatch.setattr(InProcessRun, "train_step", train_step)
    hooks = MeteredHooks()
    started = time.monotonic()
    assert run_training(spec(tiny_model_dir, tmp_path, steps=3, max_off_policy_steps=1), hooks) == "succeeded"
    assert overlapped == [True, True], (
        f"rollouts did not overlap the update ({time.monotonic() - started:.0f}s)"
    )


def test_the_first_step_is_the_synchronous_runs_and_later_ones_sample_older_checkpoints(
    tiny_model_dir, tmp_path
):
    runs = {}
    for lag in (0, 1):
        hooks = MeteredHooks()
        assert run_training(
            spec(tiny_model_dir, tmp_path / str(lag), steps=2, max_off_policy_steps=lag), hooks
        ) == ("succeeded")
        runs[lag] = hooks.metrics
    tokens = [[t.completion_token_ids for t in runs[lag][0]["trajectories"]] for lag in (0, 1)]
    assert tokens[0] == tokens[1]  # step 1: the same samples from checkpoint 0
    assert runs[1][0]["loss"] == pytest.approx(runs[0][0]["loss"], rel=1e-4, abs=1e-6)
    assert runs[0][0]["trainable_tokens"] > 0, "step 1 carried no signal: the comparison says nothing"
    # Step 2: the synchronous run samples checkpoint 1, the overlapped one checkpoint 0.
    assert [t.metrics["policy_step"] for t in runs[0][1]["trajectories"]][:1] == [1]
    assert [t.metrics["policy_step"] for t in runs[1][1]["trajectories"]][:1] == [0]
    assert runs[0][1]["off_policy_steps"] == 0.0 and runs[1][1]["off_policy_steps"] == 1.0


def test_a_failed_update_fails_the_run_and_leaves_no_thread(tiny_model_dir, tmp_path, monkeypatch):
    real_train_step = InProcessRun.train_step

    def train_step(self, groups, **kwargs):
        if self.step == 1:  # the second update
            raise RuntimeError("out of memory in the update")
        return real_train_step(self, groups, **kwargs)

    monkeypatch.setattr(InProcessRun, "train_step", train_step)
    hooks = MeteredHooks()
    with pytest.raises(RuntimeError, match="out of memory in the update"):
        run_training(spec(tiny_model_dir, tmp_path, steps=4, max_off_policy_steps=1), hooks)
    assert hooks.steps == [1]  # the step whose update succeeded is recorded, none after
    assert not [t for t in threading.enumerate() if t.name.startswith("artweb-update")]


def test_cancelling_stops_before_the_next_rollouts_and_records_no_half_step(tiny_model_dir, tmp_path):
    class Cancelling(MeteredHooks):
        def should_stop(self) -> str | None:
            return "cancelled" if len(self.steps) >= 1 else None

    hooks = Cancelling()
    assert run_training(spec(tiny_model_dir, tmp_path, steps=5, max_off_policy_steps=1), hooks) == "cancelled"
    assert hooks.steps == [1]
    assert not [t for t in threading.enumerate() if t.name.startswith("artweb-update")]


class LostAt(MeteredHooks):
    """A worker that loses the run when it comes to record ``step`` (its update may be saved)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.lost_at = step

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        return step < self.lost_at and super().record_step(
            step=step, metrics=metrics, trajectories=trajectories, path=path
        )


def adapter_tensors(root, step: int) -> dict[str, torch.Tensor]:
    return load_file(checkpoint_path(root, step) / ADAPTER_WEIGHTS)


def test_a_resumed_overlapped_run_is_the_uninterrupted_run_bit_for_bit(tiny_model_dir, tmp_path):
    whole = MeteredHooks()
    assert run_training(spec(tiny_model_dir, tmp_path / "whole", steps=5, max_off_policy_steps=2), whole) == (
        "succeeded"
    )
    broken = tmp_path / "broken"
    assert run_training(spec(tiny_model_dir, broken, steps=5, max_off_policy_steps=2), LostAt(3)) == "lost"
    resumed = MeteredHooks()
    outcome = run_training(
        spec(tiny_model_dir, broken, steps=5, resume_step=2, max_off_policy_steps=2), resumed
    )
    assert outcome == "succeeded" and resumed.steps == [3, 4, 5]
    # Steps 3, 4 sample checkpoints 0 and 1 (before the resume point) as the first time, then 2.
    assert [m["trajectories"][0].metrics["policy_step"] for m in resumed.metrics] == [0, 1, 2]
    assert [m["off_policy_steps"] for m in resumed.metrics] == [2.0, 2.0, 2.0]
    for again, first in zip(resumed.metrics, whole.metrics[2:], strict=True):
        assert [t.completion_token_ids for t in again["trajectories"]] == [
            t.completion_token_ids for t in first["trajectories"]
        ]
        assert again["loss"] == first["loss"]
    assert whole.metrics[2]["trainable_tokens"] > 0, "no signal at step 3: the comparison says nothing"
    for step in (3, 4, 5):
        same, other = adapter_tensors(broken, step), adapter_tensors(tmp_path / "whole", step)
        assert same.keys() == other.keys()
        assert all(torch.equal(same[name], other[name]) for name in same), f"step {step} differs"
    # The updates moved the weights, so equal checkpoints are not equal for want of training.
    moved = adapter_tensors(tmp_path / "whole", 2), adapter_tensors(tmp_path / "whole", 5)
    assert any(not torch.equal(moved[0][name], moved[1][name]) for name in moved[0])


def test_a_resumed_overlapped_run_whose_older_checkpoint_is_gone_restarts_the_lag_and_says_so(
    tiny_model_dir, tmp_path
):
    assert run_training(spec(tiny_model_dir, tmp_path, steps=4, max_off_policy_steps=1), LostAt(3)) == "lost"
    (checkpoint_path(tmp_path, 1) / ADAPTER_WEIGHTS).unlink()  # a retention policy deleted it
    resumed = MeteredHooks()
    outcome = run_training(
        spec(tiny_model_dir, tmp_path, steps=4, resume_step=2, max_off_policy_steps=1), resumed
    )
    assert outcome == "succeeded" and resumed.steps == [3, 4]
    assert [m["trajectories"][0].metrics["policy_step"] for m in resumed.metrics] == [2, 2]
    assert [m["off_policy_steps"] for m in resumed.metrics] == [0.0, 1.0]
    warned = [event["message"] for event in resumed.events if event["level"] == "warn"]
    assert any("Checkpoint 1 is gone" in message for message in warned), warned


def test_an_overlapped_run_takes_its_updates_data_parallel_on_the_update_thread(tiny_model_dir, tmp_path):
    # devices: 2 with the lag: rank 0's collectives run on the update thread, the follower's in its process.
    hooks = MeteredHooks()
    run = spec(tiny_model_dir, tmp_path, steps=3, max_off_policy_steps=1, devices=2)
    assert run_training(run, hooks) == "succeeded"
    assert hooks.steps == [1, 2, 3] and [m["off_policy_steps"] for m in hooks.metrics] == [0.0, 1.0, 1.0]
    updated = [m.get("update_devices") for m in hooks.metrics if m["trainable_tokens"] > 0]
    assert updated and updated == [2.0] * len(updated)
