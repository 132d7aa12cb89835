"""CPU proof for the environments (issue 7): does GRPO on the bundled SmolLM2-135M-Instruct improve
(a) a python_tools task where the answer can only come from a tool, and (b) tic-tac-toe against a
random opponent? Validation mean reward at step 0 and after training, and the per-step curve.

    .venv/bin/python -m benchmarks.env_proof --task tools --steps 20 --json /tmp/env_proof/tools.json
    .venv/bin/python -m benchmarks.env_proof --task tic_tac_toe --steps 12

Training goes through the platform's own `training.runs.loop.run_training` (rollouts through the
environment registry, grading, GRPO step, checkpoints) with in-memory hooks instead of Django.
Validation is this script's own pass: the step-0 and final checkpoints are loaded
(`Policy.resume`), every validation row is played `--val-samples` times with one fixed sampling
seed, and graded by the same reward.

Tasks:
- tools: `artweb/demo/tool_tasks.jsonl` (split train/validation): "What is the door code of the
  blue house?" with the fact only in the row's item (next to a decoy fact), so only a `lookup` with
  the right key can answer. Each row opens with two worked examples (question, lookup call, result,
  answer) in its messages: without them the base model never emitted a well-formed call (0 of 6
  at temperature 1.0, 2 malformed of 8 at 0.7, 0 of 36 in the first 3 training steps); with them
  about 1 in 12. The reward is a ladder over the model's own turns: 0.1 for writing <tool_call>,
  +0.2 for a parsed lookup call, +0.3 when a lookup returned the answer (the right key), +0.4 when
  the final reply states it.
- tic_tac_toe: seeded games against the random opponent (validation seeds kept apart), reward from
  the environment's outcome (win 1, draw 0.5, loss 0, forfeit 0; minus 0.1 per invalid move, plus
  0.05 per valid move), `move_format: lenient` (a reply without a <move> tag plays its first cell
  name: the base model never writes the tag).

Measured 2026-11-30 on the shared 2-core machine (1 torch thread, other test suites running, so
steps took 50-340 s, mean ~127 s), 2 groups x 4 samples per step, LoRA r16/alpha 32, temperature
0.7, validation 12 rows x 2 samples with one fixed seed:
- tools, 20 steps, lr 1e-3: validation 0.229 at step 0 (7 of 24 episodes called a tool, mostly
  with a wrong key) -> 0.933 at step 20 (24 of 24 called lookup with the right key). Training
  curve: 0.25 0.39 0.48 1.00 0.89 0.89 0.82 1.00 0.89 0.80 1.00 1.00 0.80 1.00 0.95 1.00 0.65 0.91
  0.62 1.00.
- tic_tac_toe, 10 steps, lr 5e-4: validation -0.083 at step 0 (24 of 24 forfeited on an invalid
  first move) -> 0.183 at step 10 (4 wins, 1 loss, 19 forfeits). Training curve: -0.09 -0.08 -0.07
  -0.07 -0.03 -0.07 0.16 -0.05 -0.02 0.15. The model learned to name cells more often, not to play.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from training.base_models import BUNDLED_MODEL, load_base_model
from training.config import SINGLE_UPDATE_RECIPE, LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import Environment, build_environment
from training.rewards import grade_trajectories
from training.rollouts.agent import rollout_groups
from training.runs.loop import run_training
from training.runs.spec import RunSpec, StepTrajectories
from training.runs.steps import checkpoint_path
from training.session.policy import Policy

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL_TASKS = REPO_ROOT / "artweb" / "demo" / "tool_tasks.jsonl"

TOOL_SYSTEM_PROMPT = (
    "You answer questions about a fictional world. You do not know its facts: look them up. "
    'Example: to find the age of Tom, reply <tool_call>{"name": "lookup", "arguments": {"key": "age of Tom"}}'
    "</tool_call> and, once the tool has answered, give the answer in a few words."
)
TOOL_REWARD = {
    "type": "python",
    "name": "tool_ladder",
    "source": (
        "def grade(sample, item):\n"
        "    messages = sample['messages']\n"
        "    # Only the model's turns count: the rows open with two worked examples.\n"
        "    last_user = max(i for i, m in enumerate(messages) if m.get('role') == 'user')\n"
        "    episode = messages[last_user + 1:]\n"
        "    wrote = any('<tool_call>' in (m.get('content') or '') for m in episode if m.get('role') == 'assistant')\n"
        "    called = any(c.get('name') == 'lookup' for c in sample['output_tools'])\n"
        "    found = any(m.get('role') == 'tool' and item['answer'] in (m.get('content') or '') for m in episode)\n"
        "    final = sample['output_text']\n"
        "    answered = found and item['answer'] in final and '<tool_call>' not in final\n"
        "    return 0.1 * wrote + 0.2 * called + 0.3 * found + 0.4 * answered\n"
    ),
}
GAME_REWARD = {"type": "environment", "field": "reward"}


def task_settings(task: str) -> dict[str, Any]:
    if task == "tools":
        rows = [json.loads(line) for line in TOOL_TASKS.read_text().splitlines() if line.strip()]
        return {
            "environment": lambda: build_environment(
                "python_tools", tools=["lookup"], max_turns=2, system_prompt=TOOL_SYSTEM_PROMPT
            ),
            "train": [row for row in rows if row["split"] == "train"],
            "validation": [row for row in rows if row["split"] == "validation"],
            "reward": TOOL_REWARD,
            "max_new_tokens": 32,
            "temperature": 0.7,
        }
    if task == "tic_tac_toe":
        return {
            "environment": lambda: build_environment(
                "tic_tac_toe",
                config={"move_format": "lenient", "valid_move_reward": 0.05, "invalid_move_penalty": 0.1},
            ),
            "train": [{"prompt": "Let's play tic-tac-toe.", "item": {"seed": seed}} for seed in range(64)],
            "validation": [
                {"prompt": "Let's play tic-tac-toe.", "item": {"seed": 10_000 + s}} for s in range(12)
            ],
            "reward": GAME_REWARD,
            "max_new_tokens": 12,
            "temperature": 0.7,
        }
    raise SystemExit(f"unknown task {task!r}")


class MemoryHooks:
    """training.runs.loop.RunHooks without Django: prints and keeps each step's metrics."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def should_stop(self) -> str | None:
        return None

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        pass

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        rewards = [t.reward for _, _, t in trajectories]
        turns = [t.metrics.get("turns", 1) for _, _, t in trajectories]
        row = {
            "step": step,
            "reward_mean": statistics.fmean(rewards),
            "turns_mean": statistics.fmean(turns),
            "step_seconds": metrics.get("step_seconds"),
            "zero_variance_groups": metrics.get("zero_variance_fraction", metrics.get("frac_zero_variance")),
        }
        self.steps.append(row)
        print(json.dumps({"train_step": row}), flush=True)
        return True

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        print(f"[{level}] {message}", flush=True)

    def record_evaluation(self, **kwargs: Any) -> None:  # the platform's evaluation: not used here
        pass


def validate(
    checkpoint: Path,
    environment: Environment,
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
    config: TrainConfig,
    lora: LoraSpec,
    cache_dir: Path,
    samples: int,
    model_source: str = BUNDLED_MODEL,
) -> dict[str, Any]:
    model, tokenizer = load_base_model(model_source, cache_dir, dtype=torch.float32)
    trainer = Policy.resume(model, tokenizer, checkpoint, config, lora)
    engine = TransformersEngine(trainer.policy.eval(), tokenizer)
    sampling = SamplingParams(
        temperature=settings["temperature"], max_new_tokens=settings["max_new_tokens"], seed=424_242
    )
    started = time.monotonic()
    groups = rollout_groups(engine, rows, environment, sampling, samples)
    grade_trajectories(
        settings["reward"], groups, [{"index": i, "data": row} for i, row in enumerate(rows)], 1.0
    )
    rewards = [t.reward for group in groups for t in group]
    outcomes: dict[str, int] = {}
    for group in groups:
        for trajectory in group:
            result = str(
                trajectory.outcome.get("result", "tool_calls" if trajectory.output_tools else "no_call")
            )
            outcomes[result] = outcomes.get(result, 0) + 1
    example = groups[0][0]
    return {
        "reward_mean": statistics.fmean(rewards),
        "n": len(rewards),
        "outcomes": outcomes,
        "seconds": time.monotonic() - started,
        "example": [m.get("content", "")[:200] for m in example.messages[-4:]],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=BUNDLED_MODEL, help="base model: the bundled one or a local directory"
    )
    parser.add_argument("--task", choices=["tools", "tic_tac_toe"], required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--val-samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/env_proof/models"))
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument(
        "--checkpoint-root",
        type=Path,
        help="validate the checkpoints of an earlier run in this folder (no training); see --validate-steps",
    )
    parser.add_argument(
        "--validate-steps", type=int, nargs="*", help="steps to validate (default: 0 and --steps)"
    )
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    settings = task_settings(arguments.task)
    config = TrainConfig.from_dict(
        {
            "steps": arguments.steps,
            "groups_per_step": arguments.groups_per_step,
            "group_size": arguments.group_size,
            "learning_rate": arguments.learning_rate,
            **SINGLE_UPDATE_RECIPE,  # what its figures in benchmarks/README.md were measured with
            "max_new_tokens": settings["max_new_tokens"],
            "temperature": settings["temperature"],
            "seed": arguments.seed,
        }
    )
    lora = LoraSpec.from_dict({"rank": 16, "alpha": 32})
    steps_to_validate = arguments.validate_steps or [0, arguments.steps]

    def validate_step(root: Path, step: int) -> dict[str, Any]:
        """The checkpoint of `step` under `root` on the validation rows, in a fresh environment."""
        with settings["environment"]() as environment:
            return validate(
                checkpoint_path(root, step),
                environment,
                settings["validation"],
                settings,
                config,
                lora,
                arguments.cache_dir,
                arguments.val_samples,
                arguments.model,
            )

    if arguments.checkpoint_root:
        for step in steps_to_validate:
            result = validate_step(arguments.checkpoint_root, step)
            print(json.dumps({"validation": f"step_{step}", **result}), flush=True)
        return {}
    root = Path(tempfile.mkdtemp(prefix=f"env-proof-{arguments.task}-"))
    print(json.dumps({"checkpoint_root": str(root)}), flush=True)
    spec = RunSpec.resolving(
        base_model_source=arguments.model,
        model_cache_dir=arguments.cache_dir,
        checkpoint_root=root,
        config=config,
        lora=lora,
        environment=settings["environment"](),
        grader_spec=settings["reward"],
        train_rows=[{"index": i, "data": row} for i, row in enumerate(settings["train"])],
        start_step=0,
        resume_step=None,
        max_grader_error_fraction=1.0,
    )
    hooks = MemoryHooks()
    started = time.monotonic()
    outcome = run_training(spec, hooks)
    train_seconds = time.monotonic() - started
    print(json.dumps({"run": outcome, "seconds": round(train_seconds, 1)}), flush=True)

    report: dict[str, Any] = {
        "task": arguments.task,
        "config": config.to_dict(),
        "train_seconds": train_seconds,
    }
    report["curve"] = hooks.steps
    for label, step in (("step_0", 0), ("final", arguments.steps)):
        result = validate_step(root, step)
        report[label] = result
        print(json.dumps({"validation": label, **result}), flush=True)
    print(
        f"{arguments.task}: validation mean reward {report['step_0']['reward_mean']:.3f} at step 0 -> "
        f"{report['final']['reward_mean']:.3f} after {arguments.steps} steps; training curve "
        + " ".join(f"{row['reward_mean']:.2f}" for row in hooks.steps),
        flush=True,
    )
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
