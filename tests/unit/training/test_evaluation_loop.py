"""The training loop evaluates the validation rows at its first checkpoint, every eval_interval steps
and at its last step, on the tiny model; a resumed run does not evaluate step 0 again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.loop import RunSpec, run_training

ROWS = [{"index": i, "data": {"prompt": f"Say {w}", "item": {"answer": w}}} for i, w in enumerate("abcd")]
VALIDATION = [
    {"index": 10 + i, "data": {"prompt": f"Say {w}", "item": {"answer": w}}} for i, w in enumerate("xyz")
]


class Hooks:
    def __init__(self) -> None:
        self.evaluations: list[dict[str, Any]] = []
        self.events: list[str] = []

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


def spec(tiny_model_dir: Path, root: Path, *, steps: int, resume_step: int | None, **config: Any) -> RunSpec:
    return RunSpec(
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
