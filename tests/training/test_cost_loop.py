"""A real run on the tiny model: every step's metrics carry what it used (training.cost), and so do
the in-run evaluations' results."""

from __future__ import annotations

from typing import Any

import pytest

from tests.training.test_learning_signal import ROWS, Hooks
from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec


class MeteredHooks(Hooks):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        self.metrics.append({**metrics, "trajectories": [t for _, _, t in trajectories]})
        return super().record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        self.evaluations.append(results)


def test_step_metrics_carry_device_seconds_and_token_counts(tiny_model_dir, tmp_path):
    spec = RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tiny_model_dir.parent,
        checkpoint_root=tmp_path,
        config=TrainConfig(steps=2, group_size=2, groups_per_step=2, max_new_tokens=3, eval_max_rows=1),
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "name": "a", "pattern": "a"},
        train_rows=ROWS,
        validation_rows=ROWS[:1],
        start_step=0,
        resume_step=None,
    )
    hooks = MeteredHooks()
    assert run_training(spec, hooks) == "succeeded"
    assert len(hooks.metrics) == 2
    for metrics in hooks.metrics:
        assert metrics["device_kind"] == "cpu" and metrics["device_count"] == 1.0
        assert metrics["device_seconds"] == metrics["step_seconds"] > 0
        generated = sum(len(t.completion_token_ids) for t in metrics["trajectories"])  # chat: one turn
        assert metrics["completion_tokens"] == generated > 0
        assert 0 <= metrics["trainable_tokens"] <= generated
        assert (metrics["judge_prompt_tokens"], metrics["judge_completion_tokens"]) == (0.0, 0.0)
    # Evaluated at the start and at the last step: each result says what it used.
    assert len(hooks.evaluations) == 2
    for results in hooks.evaluations:
        assert results["device_kind"] == "cpu" and results["device_seconds"] == results["seconds"] > 0
        assert results["completion_tokens"] > 0 and results["judge_prompt_tokens"] == 0


def test_a_client_step_counts_its_whole_wall_clock_as_device_seconds(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.training.test_client_groups import Sampler, group, trajectory
    from training.recipes.art_config import art_job_config
    from training.runs.art_groups import parse_groups
    from training.runs.art_step import ClientStepSpec, train_client_step

    sampler = Sampler(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    prompt = [{"role": "user", "content": "Hi"}]
    raw = [group(trajectory([*prompt, sampler.choice(prompt, "hello")], 1.0),
                 trajectory([*prompt, sampler.choice(prompt, "bye")], 0.0))]  # fmt: skip

    class ClientHooks:
        def started(self, *, num_sequences: int) -> None:
            pass

    spec = ClientStepSpec(
        base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
        checkpoint_root=tmp_path / "checkpoints", config=art_job_config({})[0], lora=LoraSpec(rank=2, alpha=4),
        groups=parse_groups(raw), from_step=0, resume_from=None,
    )  # fmt: skip
    metrics = train_client_step(spec, ClientHooks()).metrics
    wall = metrics["load_seconds"] + metrics["update_seconds"] + metrics["save_seconds"]
    assert metrics["device_kind"] == "cpu" and metrics["device_seconds"] == pytest.approx(wall) and wall > 0
    assert metrics["trainable_tokens"] > 0
