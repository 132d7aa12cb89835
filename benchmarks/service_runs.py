"""A platform GRPO run with its session on the host's trainer service against the same run in the
worker process, in one process, on the bundled model (or ``--tiny``).

    .venv/bin/python -m benchmarks.service_runs --steps 3 --threads 1

Each side runs in a child process of its own, one after the other, as a worker would: ``service``
starts a training.hosting.service (``--threads`` torch threads) and loads the tokenizer only;
``worker`` holds the model itself. Prints the median seconds per step of steps 2.., the ratio
service / worker, each worker process's peak memory (the service's own is not counted: it is the
host's, shared by every session), and whether the two final checkpoints are equal tensor for tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks._model import add_model_arguments, prepared_model
from benchmarks.resident_jobs import start_service
from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.hosting.resident import ServiceSessions
from training.runs.loop import run_training
from training.runs.spec import RunSpec
from training.runs.steps import checkpoint_path

ROWS = [
    {"index": i, "data": {"prompt": f"Write one word that starts with the letter {c}."}}
    for i, c in enumerate("abcdefgh")
]


class Hooks:
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def should_stop(self) -> None:
        return None

    def record_checkpoint(self, **_: object) -> None:
        pass

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        self.seconds.append(metrics["step_seconds"])
        return True

    def event(self, message: str, **_: object) -> None:
        pass

    def record_evaluation(self, **_: object) -> None:
        pass

    def is_evaluated(self, **_: object) -> bool:
        return False


def spec(source: str, cache: Path, root: Path, steps: int) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=source, model_cache_dir=cache, checkpoint_root=root,
        config=TrainConfig(steps=steps, group_size=4, groups_per_step=2, max_new_tokens=24, eval_interval=0),
        lora=LoraSpec(rank=8, alpha=16), environment=build_environment("chat"),
        grader_spec={"type": "regex", "name": "short", "pattern": r"^\W*\w+\W*$"},
        train_rows=ROWS, start_step=0, resume_step=None,
    )  # fmt: skip


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_side(args: argparse.Namespace) -> None:
    """One side's run in this (child) process; prints its figures as JSON."""
    torch.set_num_threads(args.threads)
    cache, root, source = Path(args.cache), Path(args.root), args.source
    run = spec(source, cache, root / args.side, args.steps)
    process = None
    if args.side == "service":
        process, client = start_service(root, cache, args.threads)
        run.host, run.session_id = ServiceSessions(client, holder="bench"), "run-bench"
    try:
        hooks = Hooks()
        assert run_training(run, hooks) == "succeeded"
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    print(
        json.dumps({"step_s": statistics.median(hooks.seconds[1:] or hooks.seconds), "peak_mib": peak_mib()})
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--side", choices=("service", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    if args.side:
        one_side(args)
        return {}
    cache, source = prepared_model(args)
    env = {
        "OMP_WAIT_POLICY": "PASSIVE",
        **os.environ,
    }  # as `manage.py up` runs its torch processes, unless set
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for side in ("service", "worker"):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.service_runs", "--side", side, "--root", str(root), "--source",
                 source, "--cache", str(cache), "--steps", str(args.steps), "--threads", str(args.threads)],
                env=env, check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            measured = json.loads(out.strip().splitlines()[-1])
            figures[f"{side}_step_s"], figures[f"{side}_peak_mib"] = measured["step_s"], measured["peak_mib"]
        ours, theirs = (load_file(checkpoint_path(root / side, args.steps) / "adapter_model.safetensors")
                        for side in ("service", "worker"))  # fmt: skip
        equal = all(torch.equal(ours[name], theirs[name]) for name in ours)
    figures["ratio"] = figures["service_step_s"] / figures["worker_step_s"]
    print(f"seconds per step (median of steps 2-{args.steps}): service {figures['service_step_s']:.2f}, "
          f"worker {figures['worker_step_s']:.2f}; service / worker {figures['ratio']:.3f}")  # fmt: skip
    print(f"the worker process's peak memory: {figures['service_peak_mib']:.0f} MiB with the session on the "
          f"service, {figures['worker_peak_mib']:.0f} MiB with the model in it")  # fmt: skip
    print(f"final checkpoints equal tensor for tensor: {equal}")
    return figures


if __name__ == "__main__":
    main()
