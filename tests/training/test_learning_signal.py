"""No silent non-learning: a run whose reward cannot tell samples apart says so within
``no_signal_patience`` steps (in-process loop, tiny model); the watch's rules on plain objects; and
the loop reports its phases as light message events."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.learning_signal import NO_SIGNAL, SignalWatch
from training.runs.loop import run_training
from training.runs.spec import RunSpec

ROWS = [{"index": i, "data": {"prompt": f"Say {w}", "item": {"answer": w}}} for i, w in enumerate("abcd")]


class Hooks:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.steps: list[int] = []

    def should_stop(self) -> str | None:
        return None

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        pass

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        self.steps.append(step)
        return True

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self.events.append({"message": message, "level": level, "data": data or {}, "after": len(self.steps)})

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        pass

    def is_evaluated(self, *, step: int) -> bool:
        return False


def test_constant_reward_emits_the_no_signal_warning_within_patience_steps(tiny_model_dir, tmp_path):
    spec = RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(steps=3, group_size=2, groups_per_step=2, max_new_tokens=3, no_signal_patience=2),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        # Never matches what a tiny random model writes: every sample scores 0.
        grader_spec={"type": "regex", "name": "never", "pattern": "^never-ever$"},
        train_rows=ROWS,
        start_step=0,
        resume_step=None,
        reward_name="'quickstart' v1",
    )
    hooks = Hooks()
    assert run_training(spec, hooks) == "succeeded"
    warnings = [e for e in hooks.events if e["level"] == "warn" and e["data"].get("signal")]
    assert len(warnings) == 1, "one warning per signal-less streak, not one per step"
    warning = warnings[0]
    assert warning["after"] == 2, "emitted right after the second signal-less step (patience 2)"
    assert warning["message"].startswith(NO_SIGNAL)
    assert "every sample scored 0" in warning["message"] and "'quickstart' v1" in warning["message"]
    assert warning["data"]["signal"] == "all_rewards_equal" and warning["data"]["step"] == 2

    # Phase changes (progress within a phase, "k/N groups done", comes at most every few seconds).
    phases = [
        e["data"]["phase"] for e in hooks.events if "phase" in e["data"] and "groups_done" not in e["data"]
    ]
    assert phases[0] == "loading"
    assert phases[1:6] == ["rollouts", "grading", "updating", "saving", "rollouts"]
    assert len(phases) == 1 + 4 * 3, "a few events per step, not one per sample"


@dataclass
class Sample:
    reward: float
    sub_rewards: dict[str, float] = field(default_factory=dict)


def test_a_step_with_signal_resets_the_streak_and_a_new_streak_warns_again():
    watch = SignalWatch(patience=2)
    flat = [[Sample(1.0), Sample(1.0)], [Sample(0.0), Sample(0.0)]]  # zero variance in every group
    varied = [[Sample(1.0), Sample(0.0)]]
    seen = [
        watch.observe(step=s, groups=g, metrics={"grad_norm": 0.5}) for s, g in enumerate([flat, flat, flat])
    ]
    assert [len(w) for w in seen] == [0, 1, 0]
    assert seen[1][0].data["signal"] == "zero_variance"
    assert watch.observe(step=4, groups=varied, metrics={"grad_norm": 0.5}) == []
    assert watch.observe(step=5, groups=varied, metrics={"grad_norm": 0.0}) == []
    [warning] = watch.observe(step=6, groups=varied, metrics={"grad_norm": 0.0})
    assert warning.data["signal"] == "zero_gradient"


def test_a_sub_grader_that_scores_every_sample_alike_is_named():
    watch = SignalWatch(patience=1)
    groups = [
        [Sample(1.0, {"correct": 1.0, "exact": 0.0}), Sample(0.5, {"correct": 1.0, "exact": 0.0})],
        [Sample(0.0, {"correct": 0.0, "exact": 0.0}), Sample(0.5, {"correct": 1.0, "exact": 0.0})],
    ]
    [warning] = watch.observe(step=1, groups=groups, metrics={"grad_norm": 0.1})
    assert warning.data == {"signal": "grader_constant", "step": 1, "grader": "exact", "score": 0.0}
    assert "grader 'exact' scored every sample 0" in warning.message
    assert watch.observe(step=2, groups=groups, metrics={"grad_norm": 0.1}) == [], "once per streak"
