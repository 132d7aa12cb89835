"""DPO runs on the bundled model at several learning rates: which peak DPO's default should have.

The task is the sample-efficiency benchmark's `format` task turned into preferences: each question
(artweb/demo's tasks) with ``chosen`` = "Answer: <answer>" (the format its reward asks for) and
``rejected`` = the bare answer (right, but not in the form; shorter, so the base model
likes it more: preference accuracy starts low). The runs use TrainConfig's
defaults (cosine schedule, one warm-up step, two minibatches) with only the learning rate set, and
report at steps 0, 3, 6 and 12: the held-out DPO loss and preference accuracy (the policy gives
each validation row's chosen reply a higher likelihood than its rejected one) and the held-out reward of its
greedy answers to the validation questions under the format task's reward. Same rows, same order
and seed for every rate; fp32 on the CPU.

    python -m benchmarks.dpo_rates --rates 5e-5 1e-4 2e-4 5e-4 --json /tmp/dpo.json
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.demo_learning import MemoryHooks
from benchmarks.sample_efficiency import FORMAT_REWARD, REPO_ROOT, task
from training.base_models import BUNDLED_MODEL
from training.config import LoraSpec, TrainConfig
from training.runs.loop import run_training
from training.runs.spec import RunSpec

EVAL_AT = (3, 6, 12)


def preference_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"index": row["index"], "data": {
            "prompt": row["data"]["prompt"], "item": row["data"]["item"],
            "chosen": f"Answer: {row['data']['item']['answer']}",
            "rejected": row["data"]["item"]["answer"],
        }}
        for row in rows
    ]  # fmt: skip


class DpoHooks(MemoryHooks):
    """MemoryHooks for a run without rollouts: each step's held-out measurements."""

    def __init__(self) -> None:
        super().__init__(echo=False)
        self.metrics: dict[int, dict[str, float]] = {}

    def record_step(self, *, step, metrics, trajectories, path) -> bool:  # type: ignore[no-untyped-def]
        self.metrics[step] = {name: float(value) for name, value in metrics.items()
                              if isinstance(value, (int, float))}  # fmt: skip
        return True


def dpo_run(rate: float, arguments: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    config = TrainConfig.from_dict({
        "steps": arguments.steps, "groups_per_step": arguments.rows_per_step, "learning_rate": rate,
        "seed": arguments.seed, "eval_interval": 3, "eval_max_rows": len(settings["validation"]),
        "eval_temperature": 0.0, "max_new_tokens": settings["max_new_tokens"], "dpo_beta": arguments.beta,
    })  # fmt: skip
    spec = RunSpec.resolving(
        base_model_source=arguments.model,
        model_cache_dir=arguments.cache_dir,
        checkpoint_root=Path(tempfile.mkdtemp(prefix="dpo-rates-")),
        config=config,
        lora=LoraSpec(rank=8, alpha=16),
        environment=settings["environment"](),
        grader_spec=FORMAT_REWARD,
        train_rows=preference_rows(settings["train"]),
        validation_rows=preference_rows(settings["validation"]),
        start_step=0,
        resume_step=None,
        objective="dpo",
    )
    hooks = DpoHooks()
    started = time.monotonic()
    outcome = run_training(spec, hooks)
    before = next(e["data"] for e in hooks.events if e["message"].startswith("Held-out before training"))
    curve = {0: {"loss": before["heldout_loss"], "accuracy": before["heldout_preference_accuracy"]}}
    for step in EVAL_AT:
        metrics = hooks.metrics.get(step, {})
        if "heldout_loss" in metrics:
            curve[step] = {
                "loss": metrics["heldout_loss"],
                "accuracy": metrics["heldout_preference_accuracy"],
            }
    for step, evaluation in hooks.evaluations.items():
        if step in curve:
            curve[step]["reward"] = evaluation["reward_mean"]
    return {"outcome": outcome, "held_out": curve, "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[5e-5, 1e-4, 2e-4, 5e-4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows-per-step", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "data" / "models")
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    settings = task("format")
    report: dict[str, Any] = {"arguments": {k: str(v) for k, v in vars(arguments).items()}, "rates": {}}
    for rate in arguments.rates:
        report["rates"][str(rate)] = result = dpo_run(rate, arguments, settings)
        print(json.dumps({"rate": rate, **result}), flush=True)
    print(f"{'rate':>8} " + " ".join(f"{'step ' + str(s):>22}" for s in (0, *EVAL_AT)))
    for rate, result in report["rates"].items():
        cells = []
        for step in (0, *EVAL_AT):
            point = result["held_out"].get(step)
            cells.append("-" if point is None else
                         f"{point['loss']:.3f}/{point['accuracy']:.2f}/{point.get('reward', float('nan')):.3f}")  # fmt: skip
        print(f"{rate:>8} " + " ".join(f"{cell:>22}" for cell in cells))
    print("cells: held-out DPO loss / preference accuracy / format reward of greedy answers")
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
