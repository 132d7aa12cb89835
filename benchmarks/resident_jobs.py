"""Client training jobs on a kept session against jobs that load the base model and the checkpoint
from disk, in one run, on the bundled model (or ``--tiny``). Three sides, interleaved job by job:

- ``from disk``: every job loads the base model and its checkpoint (RESIDENT_SESSIONS=0);
- ``kept``: the worker process keeps the session (training.hosting.resident.ResidentSessions, a SessionPool);
- ``service``: the host's trainer service keeps it (training.hosting.service in a child process;
  the job drives it over HTTP, as a worker with TRAINER_SERVICE_URL does).

    .venv/bin/python -m benchmarks.resident_jobs --jobs 4 --threads 1

Each side runs ``--jobs`` consecutive jobs of one model on the same small upload (2 trajectories,
one group); the first job of each side loads. Prints the median seconds of load, update and save
and of the whole job for jobs 2.., and each side's ratio to ``from disk``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._model import add_model_arguments, prepared_model
from training.base_models import load_base_model, load_tokenizer
from training.config import LoraSpec
from training.hosting.client import TrainerServiceClient
from training.hosting.resident import ResidentSessions, ServiceSessions, SessionKey
from training.model_files import context_length
from training.recipes.art_config import art_job_config
from training.runs.art_groups import parse_groups
from training.runs.art_step import ClientStepSpec, train_client_step

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("from disk", "kept", "service")


class Hooks:
    def started(self, *, num_sequences: int) -> None:
        pass


def start_service(root: Path, cache: Path, threads: int) -> tuple[subprocess.Popen, TrainerServiceClient]:
    env = {**os.environ, "TRAINER_SERVICE_TOKEN": "bench", "TORCH_THREADS": str(threads)}
    process = subprocess.Popen(
        [sys.executable, "-m", "training.hosting.service", "--root", str(root), "--port", "0",
         "--model-cache-dir", str(cache)],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert process.stdout is not None
    url = process.stdout.readline().split()[-1]
    client = TrainerServiceClient(url, token="bench")
    for _ in range(300):
        try:
            client.stats()
            break
        except OSError:
            time.sleep(0.1)
    return process, client


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)
    from tests.training.test_client_groups import Sampler, group, trajectory

    tokenizer = load_tokenizer(source, cache)
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Name a colour."}]
    groups = parse_groups([group(trajectory([*prompt, sampler.choice(prompt, "Red.")], 1.0),
                                 trajectory([*prompt, sampler.choice(prompt, "I like green a lot.")], 0.0))])  # fmt: skip
    config, options = art_job_config({"learning_rate": 1e-4})
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        process, client = start_service(root, cache, args.threads)
        try:
            keepers = {
                "kept": ResidentSessions(lambda s: load_base_model(s, cache), capacity=1, spill_dir=root / "spill"),
                "service": ServiceSessions(client, holder="bench",
                                           load_tokenizer=lambda s: (tokenizer, context_length(s, cache))),
            }  # fmt: skip
            paths: dict[str, Path | None] = {side: None for side in SIDES}
            for step in range(args.jobs):  # the sides interleaved, job by job
                for side in SIDES:
                    spec = ClientStepSpec(base_model_source=source, model_cache_dir=cache,
                                          checkpoint_root=root / side.replace(" ", "-"), config=config,
                                          options=options, lora=LoraSpec(rank=8, alpha=16), groups=groups,
                                          from_step=step, resume_from=paths[side])  # fmt: skip
                    keeper = keepers.get(side)
                    key = SessionKey(side, step, str(paths[side]), source)
                    if keeper is not None:
                        keeper.attach(spec, key)
                    result = train_client_step(spec, Hooks())
                    if keeper is not None:
                        keeper.settle(side, SessionKey(side, step + 1, str(result.path), source))
                    paths[side] = result.path
                    results[side].append(result.metrics)
        finally:
            process.terminate()
            process.wait(timeout=30)
    summary: dict[str, dict[str, float]] = {}
    for side, metrics in results.items():
        later = metrics[1:] or metrics
        summary[side] = {
            name: statistics.median(m[f"{name}_seconds"] for m in later)
            for name in ("load", "update", "save")
        }
        summary[side]["job"] = statistics.median(
            m["load_seconds"] + m["update_seconds"] + m["save_seconds"] for m in later
        )
    for side, row in summary.items():
        ratio = row["job"] / summary["from disk"]["job"]
        print(f"{side:9s}: load {row['load']:.3f} s, update {row['update']:.3f} s, save {row['save']:.3f} s, "
              f"whole job {row['job']:.3f} s (median of jobs 2-{args.jobs}); / from disk {ratio:.3f}")  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
