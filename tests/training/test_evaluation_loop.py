"""The training loop evaluates the validation rows at its first checkpoint, every eval_interval steps
and at its last step, on the tiny model; a resumed run does not evaluate step 0 again, but does
evaluate its resume step when that was due and the dead worker never recorded its evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec

ROWS = [{"index": i, "data": {"prompt": f"Say {w}", "item": {"answer": w}}} for i, w in enumerate("abcd")]
VALIDATION = [
    {"index": 10 + i, "data": {"prompt": f"Say {w}", "item": {"answer": w}}} for i, w in enumerate("xyz")
]


class Hooks:
    def __init__(self, evaluated: set[int] | None = None) -> None:
        self.evaluations: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.evaluated = set(evaluated or ())  # steps whose evaluation is already recorded
        self.asked: list[int] = []

    def should_stop(self) -> str | None:
        return None

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        pass

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        return True

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self.events.append(message)

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        self.evaluations.append({"step": step, "results": results, "samples": samples})
        self.evaluated.add(step)

    def is_evaluated(self, *, step: int) -> bool:
        self.asked.append(step)
        return step in self.evaluated


def spec(tiny_model_dir: Path, root: Path, *, steps: int, resume_step: int | None, **config: Any) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=root,
        config=TrainConfig(steps=steps, group_size=2, groups_per_step=1, max_new_tokens=4, **config),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "name": "has-x", "pattern": "x"},
        train_rows=ROWS,
        start_step=0,
        resume_step=resume_step,
        validation_rows=VALIDATION,
    )


def test_evaluations_at_step_zero_every_interval_and_the_end_then_not_again_on_resume(
    tiny_model_dir, tmp_path
):
    hooks = Hooks()
    outcome = run_training(
        spec(tiny_model_dir, tmp_path, steps=3, resume_step=None, eval_interval=2, eval_max_rows=2), hooks
    )
    assert outcome == "succeeded"
    assert [e["step"] for e in hooks.evaluations] == [0, 2, 3]
    first = hooks.evaluations[0]
    assert first["results"]["n"] == 2 and first["results"]["grader_means"].keys() == {"has-x"}
    assert [s.task_row_index for s in first["samples"]] == [10, 11], "the first validation rows by index"
    # Chat: one model turn per episode.
    assert all(s.metrics["turns"] == 1 for e in hooks.evaluations for s in e["samples"])

    resumed = Hooks()
    run_training(spec(tiny_model_dir, tmp_path, steps=4, resume_step=3, eval_max_rows=1), resumed)
    assert [e["step"] for e in resumed.evaluations] == [4], (
        "a resumed run evaluates its end, not step 0 again"
    )
    assert resumed.evaluations[0]["results"]["n"] == 1


def test_resumed_run_evaluates_its_resume_step_when_due_and_missing(tiny_model_dir, tmp_path):
    # A worker trained steps 1-2 and recorded step 2, then died before evaluating it.
    first = Hooks()
    run_training(spec(tiny_model_dir, tmp_path, steps=2, resume_step=None, eval_interval=2), first)
    assert [e["step"] for e in first.evaluations] == [0, 2]
    lost = first.evaluations[-1]

    resumed = Hooks(evaluated={0})  # the database has step 0's evaluation, not step 2's
    assert run_training(spec(tiny_model_dir, tmp_path, steps=4, resume_step=2, eval_interval=2), resumed) == (
        "succeeded"
    )
    assert resumed.asked == [2]
    assert [e["step"] for e in resumed.evaluations] == [2, 4], "the missing step 2, then the end"
    recovered = resumed.evaluations[0]
    assert [(s.task_row_index, s.messages, s.reward) for s in recovered["samples"]] == [
        (s.task_row_index, s.messages, s.reward) for s in lost["samples"]
    ], "the same greedy answers the dead worker would have recorded"

    # Once recorded, a resume at that step (here: the run's last) does not evaluate it again.
    again = Hooks(evaluated={0, 2})
    run_training(spec(tiny_model_dir, tmp_path, steps=2, resume_step=2, eval_interval=2), again)
    assert again.asked == [2] and again.evaluations == []
