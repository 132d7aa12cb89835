"""Client training jobs started from a kept session (training.resident) against jobs that load
the base model and the checkpoint from disk, in one run, on the bundled model (or ``--tiny``).

    .venv/bin/python -m benchmarks.resident_jobs --jobs 4 --threads 1

Each side runs ``--jobs`` consecutive jobs of one model on the same small upload (2 trajectories,
one group); the first job of each side loads (it has nothing kept). Prints the median seconds of
load and of the whole job for jobs 2.., and the ratio kept / from disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from training.art_config import art_job_config
from training.base_models import BUNDLED_MODEL, build_tiny_model, load_base_model
from training.client_groups import parse_groups
from training.client_step import ClientStepSpec, train_client_step
from training.config import LoraSpec

ROOT = Path(__file__).resolve().parents[1]


class Hooks:
    def started(self, *, num_sequences: int) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--cache", default=str(ROOT / "data" / "models"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(args.cache)
    source = str(build_tiny_model(cache / "tiny")) if args.tiny else BUNDLED_MODEL
    load_base_model(source, cache)  # converted once, outside the timings
    from tests.training.test_client_groups import Sampler, group, trajectory

    local = cache / "tiny" if args.tiny else None
    tokenizer = AutoTokenizer.from_pretrained(str(local)) if local else load_base_model(source, cache)[1]
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Name a colour."}]
    groups = parse_groups([group(trajectory([*prompt, sampler.choice(prompt, "Red.")], 1.0),
                                 trajectory([*prompt, sampler.choice(prompt, "I like green a lot.")], 0.0))])  # fmt: skip
    config, options = art_job_config({"learning_rate": 1e-4})
    results: dict[str, list[dict]] = {"from disk": [], "kept": []}
    with tempfile.TemporaryDirectory() as scratch:
        state: dict[str, object] = {"from disk": (None, None), "kept": (None, None)}
        for step in range(args.jobs):  # the two sides interleaved, job by job
            for name in ("from disk", "kept"):
                path, trainer = state[name]  # type: ignore[misc]
                spec = ClientStepSpec(base_model_source=source, model_cache_dir=cache,
                                      checkpoint_root=Path(scratch) / name.replace(" ", "-"), config=config,
                                      options=options, lora=LoraSpec(rank=8, alpha=16), groups=groups,
                                      from_step=step, resume_from=path,
                                      resident=trainer if name == "kept" else None)  # fmt: skip
                result = train_client_step(spec, Hooks())
                state[name] = (result.path, result.trainer)
                results[name].append(result.metrics)
    for name, metrics in results.items():
        later = metrics[1:]
        load = statistics.median(m["load_seconds"] for m in later)
        whole = statistics.median(m["load_seconds"] + m["update_seconds"] + m["save_seconds"] for m in later)
        print(f"{name:9s}: load {load:.3f} s, whole job {whole:.3f} s (median of jobs 2-{args.jobs})")
    ratio = statistics.median(
        m["load_seconds"] + m["update_seconds"] + m["save_seconds"] for m in results["kept"][1:]
    ) / statistics.median(
        m["load_seconds"] + m["update_seconds"] + m["save_seconds"] for m in results["from disk"][1:]
    )
    print(f"ratio kept / from disk (whole job): {ratio:.3f}")


if __name__ == "__main__":
    main()
