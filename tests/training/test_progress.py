"""Honest progress inside a phase: the rollouts of a step say how many groups are done, as the
engine reports rows finishing (not per token), and the loop turns that into at most one event per
interval."""

from __future__ import annotations

from typing import Any

from tests.training.test_learning_signal import ROWS, Hooks
from training.config import LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import EnvironmentSpec, build_environment
from training.rollouts.agent import RolloutProgress, rollout_groups
from training.runs import progress
from training.runs.loop import run_training
from training.runs.spec import RunSpec


def test_rollouts_report_each_finished_row_and_then_the_groups_done(tiny_model):
    model, tokenizer = tiny_model
    reports: list[RolloutProgress] = []
    rows = [{"prompt": "first"}, {"prompt": "second"}, {"prompt": "third"}]
    rollout_groups(
        TransformersEngine(model, tokenizer),
        rows,
        EnvironmentSpec(),
        SamplingParams(max_new_tokens=4, seed=0),
        group_size=2,
        on_progress=reports.append,
    )
    finished = [r.finished_in_turn for r in reports]
    assert finished[:6] == [1, 2, 3, 4, 5, 6], "one report per row as it finishes"
    assert all(r.running_in_turn == 6 and r.groups == 3 and r.turn == 1 for r in reports)
    # Groups count as done once the environment has answered the turn: the last report.
    assert [r.groups_done for r in reports[:-1]] == [0] * (len(reports) - 1)
    assert reports[-1].groups_done == 3 and reports[-1].finished_in_turn == 6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(
    done: int, finished: int, *, groups: int = 4, turn: int = 1, max_turns: int = 1
) -> RolloutProgress:
    return RolloutProgress(turn, max_turns, finished, 8, done, groups)


def test_progress_events_are_throttled_and_leave_the_end_to_the_next_phase():
    hooks, clock = Hooks(), Clock()
    report = progress.progress_events(
        hooks, "rollouts", "Step 3/20: rollouts", interval_s=5, clock=clock, step=3
    )
    report(_progress(0, 1))  # too soon after the phase began
    clock.now += 6
    report(_progress(1, 3))
    report(_progress(2, 5))  # too soon after the last one
    clock.now += 6
    report(_progress(4, 8))  # every group done: the grading phase says so
    clock.now += 1
    assert [e["message"] for e in hooks.events] == [
        "Step 3/20: rollouts: 1/4 groups done (3/8 samples finished this turn)"
    ]
    data: dict[str, Any] = hooks.events[0]["data"]
    assert data == {
        "phase": "rollouts", "groups": 4, "groups_done": 1, "turn": 1, "samples_finished": 3,
        "samples_running": 8, "step": 3,
    }  # fmt: skip


def test_multi_turn_progress_names_the_turn():
    hooks, clock = Hooks(), Clock()
    report = progress.progress_events(hooks, "evaluating", "Evaluating step 0", interval_s=1, clock=clock)
    clock.now += 2
    report(_progress(1, 2, turn=2, max_turns=4))
    assert hooks.events[0]["message"] == (
        "Evaluating step 0: 1/4 groups done, turn 2/4 (2/8 samples finished this turn)"
    )


def test_the_loop_reports_rollout_and_evaluation_progress(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)  # every report that is not the end
    spec = RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(steps=1, group_size=2, groups_per_step=2, max_new_tokens=3),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "pattern": "a"},
        train_rows=ROWS,
        validation_rows=ROWS[:2],
        start_step=0,
        resume_step=None,
    )
    hooks = Hooks()
    assert run_training(spec, hooks) == "succeeded"
    rollouts = [
        e for e in hooks.events if e["data"].get("phase") == "rollouts" and "groups_done" in e["data"]
    ]
    assert rollouts and all(e["data"]["groups"] == 2 and e["data"]["step"] == 1 for e in rollouts)
    assert [e["data"]["samples_finished"] for e in rollouts] == [1, 2, 3, 4]
    evaluating = [
        e for e in hooks.events if e["data"].get("phase") == "evaluating" and "groups_done" in e["data"]
    ]
    assert {e["data"]["step"] for e in evaluating} == {0, 1}
    assert all(e["message"].startswith(f"Evaluating step {e['data']['step']}: ") for e in evaluating)


def test_a_step_is_named_by_the_models_step_and_its_place_in_a_continuing_run():
    assert progress.step_label(3, start_step=0, final_step=20) == "Step 3/20"
    assert progress.step_label(23, start_step=20, final_step=23) == "Step 23 (3 of 3 in this run)"
    assert progress.step_label(20, start_step=20, final_step=23) == "Step 20 (0 of 3 in this run)"


def test_a_run_that_continues_a_model_names_every_phase_by_the_models_step(tiny_model_dir, tmp_path):
    spec = RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(steps=2, group_size=2, groups_per_step=1, max_new_tokens=2),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "pattern": "a"},
        train_rows=ROWS,
        start_step=20,  # the model's checkpoints so far are steps 0..20
        resume_step=None,
    )
    hooks = Hooks()
    assert run_training(spec, hooks) == "succeeded"
    assert hooks.steps == [21, 22]
    phases = [
        e for e in hooks.events if e["data"].get("phase") in {"rollouts", "grading", "updating", "saving"}
    ]
    assert {e["data"]["phase"] for e in phases} == {"rollouts", "grading", "updating", "saving"}
    for event in phases:
        step = event["data"]["step"]
        assert event["message"].startswith(f"Step {step} ({step - 20} of 2 in this run): "), event["message"]


def test_a_continuation_says_it_loads_the_models_checkpoint_and_a_restart_that_it_resumes(
    tiny_model_dir, tmp_path
):
    def spec(start_step: int, resume_step: int | None, steps: int = 1) -> RunSpec:
        return RunSpec.resolving(
            base_model_source=str(tiny_model_dir), model_cache_dir=tiny_model_dir.parent, checkpoint_root=tmp_path,
            config=TrainConfig(steps=steps, group_size=2, groups_per_step=1, max_new_tokens=2),
            lora=LoraSpec(rank=2, alpha=4), environment=build_environment("chat"),
            grader_spec={"type": "regex", "pattern": "a"}, train_rows=ROWS, start_step=start_step,
            resume_step=resume_step,
        )  # fmt: skip

    assert run_training(spec(0, None), Hooks()) == "succeeded"  # checkpoints 0 and 1
    continued, restarted = Hooks(), Hooks()
    assert run_training(spec(1, 1), continued) == "succeeded"  # a new run on the model: from step 1
    assert run_training(spec(0, 1, steps=2), restarted) == "succeeded"  # a run picked up at its step 1
    assert "Loaded checkpoint step 1: training continues from it" in [e["message"] for e in continued.events]
    assert "Resumed from checkpoint step 1" in [e["message"] for e in restarted.events]
