"""run_training without Celery or Django, with a python_tools environment from the registry on the
tiny model: rollouts go through the environment, graders see the transcript, checkpoints are
written, and the environment is closed when the run ends."""

from pathlib import Path
from typing import Any

from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec
from training.runs.steps import checkpoint_path


class Hooks:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.events: list[str] = []
        self.checkpoints: list[int] = []

    def should_stop(self):
        return None

    def record_checkpoint(self, *, step, path, metrics):
        self.checkpoints.append(step)

    def record_step(self, *, step, metrics, trajectories, path):
        self.steps.append({"step": step, "metrics": metrics, "trajectories": trajectories})
        return True

    def event(self, message, *, level="info", data=None):
        self.events.append(message)

    def record_evaluation(self, **kwargs):
        pass


def test_run_training_drives_a_python_tools_environment(tiny_model_dir: Path, tmp_path: Path):
    environment = build_environment(
        "python_tools", tools=["calculator", "lookup"], max_turns=2, system_prompt="Use the tools."
    )
    closed = []
    environment.close = lambda: closed.append(True)  # type: ignore[method-assign]
    rows = [
        {
            "index": i,
            "data": {"prompt": f"What is {i} + {i}?", "item": {"answer": str(2 * i), "facts": {"x": i}}},
        }
        for i in range(3)
    ]
    spec = RunSpec.resolving(
        base_model_source=str(tiny_model_dir),
        model_cache_dir=tmp_path / "cache",
        checkpoint_root=tmp_path / "checkpoints",
        config=TrainConfig.from_dict(
            {"steps": 2, "groups_per_step": 2, "group_size": 2, "max_new_tokens": 8, "learning_rate": 1e-3}
        ),
        lora=LoraSpec.from_dict({"rank": 4, "alpha": 8}),
        environment=environment,
        grader_spec={
            "type": "python",
            "source": (
                "def grade(sample, item):\n"
                "    assert sample['messages'][0]['content'].startswith('Use the tools.')\n"
                "    assert sample['outcome'] == {}\n"
                "    return float(len(sample['output_text']) % 3) / 2\n"
            ),
        },
        train_rows=rows,
        start_step=0,
        resume_step=None,
        max_grader_error_fraction=0.0,
    )
    hooks = Hooks()
    assert run_training(spec, hooks) == "succeeded"

    assert closed == [True]
    assert [step["step"] for step in hooks.steps] == [1, 2] and hooks.checkpoints == [0]
    assert "Environment tools: calculator, lookup" in hooks.events
    for step in hooks.steps:
        assert step["metrics"]["grader_errors"] == 0.0
        trajectories = [t for _, _, t in step["trajectories"]]
        assert len(trajectories) == 4
        for trajectory in trajectories:
            system = trajectory.messages[0]["content"]
            assert system.startswith("Use the tools.\n\nYou can call tools.") and '"name": "lookup"' in system
            assert set(trajectory.metrics) >= {"turns", "tool_calls", "tool_errors", "tool_timeouts"}
            assert len(trajectory.completion_mask) == len(trajectory.completion_token_ids)
            assert trajectory.reward in (0.0, 0.5, 1.0)
    assert (checkpoint_path(spec.checkpoint_root, 2) / "state.json").exists()
