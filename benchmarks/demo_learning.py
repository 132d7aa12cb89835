"""Does the demo learn? The `make up` run (artweb.demo: task set, reward, steps; projects.defaults:
config) trained through the platform's own `training.runs.loop.run_training` with in-memory hooks,
and its greedy held-out reward (the 24 validation rows, the loop's own evaluation at step 0 and at
the end) printed per seed, with the gain's range over the seeds.

    for t in 1 2; do for s in 0 1 2 3 4; do OMP_NUM_THREADS=$t .venv/bin/python -m \
        benchmarks.demo_learning --seeds $s --threads $t --json /tmp/demo-t$t-s$s.json; done; done

(one process a run, as the README's figures were measured). One seed draws other samples under
another float order (here 1 or 2 torch threads; another CPU's kernels do the same), so the demo is
measured over both. Figures: README.md ("The demo").
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from artweb.demo import REWARD_SPEC, STEPS, SYSTEM_PROMPT, TASKS_PATH
from projects.defaults import RUN_CONFIG
from training.base_models import BUNDLED_MODEL
from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec, StepTrajectories


def demo_rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, validation) rows as the loop takes them: ``{"index", "data"}``."""
    rows = [json.loads(line) for line in TASKS_PATH.read_text().splitlines() if line.strip()]
    train: list[dict[str, Any]] = []
    validation: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        split = row.pop("split", "train")
        (validation if split == "validation" else train).append({"index": index, "data": row})
    return train, validation


class MemoryHooks:
    """training.runs.loop.RunHooks without Django: keeps step metrics, evaluations and events."""

    def __init__(self, echo: bool = True) -> None:
        self.steps: list[dict[str, Any]] = []
        self.evaluations: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.echo = echo

    def should_stop(self) -> str | None:
        return None

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        pass

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        row = {
            "step": step,
            "reward_mean": statistics.fmean(t.reward for _, _, t in trajectories),
            "zero_variance_fraction": metrics.get("zero_variance_fraction"),
            "step_seconds": round(metrics.get("step_seconds", 0.0), 1),
            "off_policy_steps": metrics.get("off_policy_steps"),
        }
        self.steps.append(row)
        if self.echo:
            print(json.dumps({"train_step": row}), flush=True)
        return True

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        self.events.append({"message": message, "level": level, "data": data or {}})
        if self.echo:
            print(f"[{level}] {message}", flush=True)

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        self.evaluations[step] = {
            "reward_mean": results["reward_mean"],
            "pass_rate": results["pass_rate"],
            "grader_means": results["grader_means"],
            "replies": [s.messages[-1].get("content", "") for s in samples[:6]],
        }
        if self.echo:
            print(json.dumps({"evaluation": step, **self.evaluations[step]}), flush=True)

    def is_evaluated(self, *, step: int) -> bool:
        return step in self.evaluations


def demo_run(*, steps: int, seed: int, cache_dir: Path, model: str = BUNDLED_MODEL,
             overrides: dict[str, Any] | None = None, echo: bool = True, service: Any = None,
             rollout_server: Any = None) -> MemoryHooks:  # fmt: skip
    """One demo run of ``steps`` steps; its hooks hold the evaluations at step 0 and ``steps``.
    ``service``: a trainer service's client the run's session lives on (training.hosting.service_run).
    ``rollout_server``: the inference server an overlapped run's rollouts go to (``rollouts_on``)."""
    train, validation = demo_rows()
    config = TrainConfig.from_dict({**RUN_CONFIG, **(overrides or {}), "steps": steps, "seed": seed})
    spec = RunSpec.resolving(
        base_model_source=model,
        model_cache_dir=cache_dir,
        checkpoint_root=Path(tempfile.mkdtemp(prefix=f"demo-learning-{seed}-")),
        config=config,
        lora=LoraSpec.from_dict({}),  # the demo's model takes the platform's default LoRA
        environment=build_environment("chat", system_prompt=SYSTEM_PROMPT),
        grader_spec=REWARD_SPEC,
        train_rows=train,
        start_step=0,
        resume_step=None,
        validation_rows=validation,
        rollout_server=rollout_server,
    )
    if service is not None:
        from training.hosting.resident import ServiceSessions

        spec.host, spec.session_id = ServiceSessions(service, holder="demo-learning"), f"run-{seed}"
    hooks = MemoryHooks(echo=echo)
    run_training(spec, hooks)
    return hooks


def evaluate_checkpoint(checkpoint: Path, *, cache_dir: Path, model: str = BUNDLED_MODEL) -> dict[str, Any]:
    """Greedy held-out reward of one saved checkpoint (a run's folder ``step-000012``), as the
    loop's own evaluation measures it: same rows, same reward, same sampling."""
    from training.base_models import load_base_model
    from training.engines.base import SamplingParams
    from training.engines.transformers_engine import TransformersEngine
    from training.runs.evaluation import LocalPolicy, evaluate
    from training.session.policy import Policy

    _, validation = demo_rows()
    config = TrainConfig.from_dict(RUN_CONFIG)
    base, tokenizer = load_base_model(model, cache_dir, dtype=torch.float32)
    trainer = Policy.resume(base, tokenizer, checkpoint, config, LoraSpec.from_dict({}))
    engine = TransformersEngine(trainer.policy.eval(), tokenizer)
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=config.max_new_tokens, seed=99_991)
    with build_environment("chat", system_prompt=SYSTEM_PROMPT) as environment:
        result = evaluate(LocalPolicy(engine=engine, sampling=sampling), validation, environment, REWARD_SPEC)
    return {
        "checkpoint": str(checkpoint),
        "reward_mean": result.results["reward_mean"],
        "grader_means": result.results["grader_means"],
        "replies": [s.messages[-1].get("content", "") for s in result.samples],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="the demo's (artweb.demo.STEPS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/demo_learning/models"))
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--learning-rate", type=float, help="instead of the demo's")
    parser.add_argument(
        "--overrides",
        type=json.loads,
        default={},
        help="JSON hyperparameters over the demo's, e.g. '{\"ppo_epochs\": 2}'",
    )
    parser.add_argument("--checkpoint", type=Path, nargs="*", help="only evaluate these checkpoint folders")
    parser.add_argument(
        "--service", action="store_true", help="the runs' sessions on a trainer service (a child process)"
    )
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    if arguments.checkpoint:
        results = [
            evaluate_checkpoint(c, cache_dir=arguments.cache_dir, model=arguments.model)
            for c in arguments.checkpoint
        ]
        for result in results:
            print(json.dumps(result), flush=True)
        return {"checkpoints": results}
    report: dict[str, Any] = {
        "steps": arguments.steps,
        "config": {**RUN_CONFIG, **arguments.overrides},
        "seeds": {},
    }
    with contextlib.ExitStack() as stack:
        service = stack.enter_context(_service(arguments)) if arguments.service else None
        for seed in arguments.seeds:
            _one_seed(arguments, seed, report, service)
    gains = [result["gain"] for result in report["seeds"].values()]
    report["gain_range"] = [min(gains), max(gains)]
    print(json.dumps({"threads": arguments.threads, "gain_range": report["gain_range"]}), flush=True)
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=2))
    return report


@contextlib.contextmanager
def _service(arguments: argparse.Namespace) -> Any:
    """A trainer service rooted at the temporary folder (where the runs' checkpoints go)."""
    from benchmarks.resident_jobs import start_service

    process, client = start_service(Path(tempfile.gettempdir()), arguments.cache_dir, arguments.threads)
    try:
        yield client
    finally:
        process.terminate()
        process.wait(timeout=30)


def _one_seed(arguments: argparse.Namespace, seed: int, report: dict[str, Any], service: Any) -> None:
    started = time.monotonic()
    overrides = dict(arguments.overrides)
    if arguments.learning_rate:
        overrides["learning_rate"] = arguments.learning_rate
    hooks = demo_run(
        steps=arguments.steps,
        seed=seed,
        cache_dir=arguments.cache_dir,
        model=arguments.model,
        overrides=overrides,
        service=service,
    )
    before, after = hooks.evaluations[0], hooks.evaluations[arguments.steps]
    report["seeds"][seed] = {
        "before": before["reward_mean"],
        "after": after["reward_mean"],
        "gain": round(after["reward_mean"] - before["reward_mean"], 3),
        "pass_rate_before": before["pass_rate"],
        "pass_rate_after": after["pass_rate"],
        "seconds": round(time.monotonic() - started, 1),
        "curve": [round(s["reward_mean"], 3) for s in hooks.steps],
        "replies_before": before["replies"],
        "replies_after": after["replies"],
    }
    print(json.dumps({"seed": seed, **report["seeds"][seed]}), flush=True)
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
