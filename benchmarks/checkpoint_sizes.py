"""Disk per checkpoint before and after retention keeps only the adapter (bytes of the adapter vs
the optimizer/RNG state that Policy.save_checkpoint also writes), and the time to export merged
weights (load the base model in fp32, merge the adapter, write the Hugging Face folder), against
the time to load the base model alone, measured in the same run.

    .venv/bin/python -m benchmarks.checkpoint_sizes --models tiny bundled --threads 1

The LoRA shape is the platform's default (the demo's model: rank 8, alpha 16, all seven
projections). One update on a two-sample group gives the optimizer its moments (AdamW's
exp_avg and exp_avg_sq, one fp32 tensor each per trainable parameter).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from training.base_models import BUNDLED_MODEL, build_tiny_model, load_base_model
from training.config import LoraSpec, TrainConfig
from training.export import merge_adapter, model_card, save_merged
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.trajectory import TrainGroup, TrainSample
from training.session.policy import Policy

STATE_FILES = ("optimizer.pt", "rng_state.pt")


def sizes(folder: Path) -> dict[str, int]:
    return {path.name: path.stat().st_size for path in folder.iterdir() if path.is_file()}


def measure(name: str, source: str, cache_dir: Path, scratch: Path) -> None:
    started = time.perf_counter()
    base, tokenizer = load_base_model(source, cache_dir, dtype=torch.float32)
    load_seconds = time.perf_counter() - started
    trainer = Policy(base, tokenizer, TrainConfig(), LoraSpec.from_dict({}))
    group = TrainGroup(
        [
            TrainSample([5, 6, 7, 8], [9, 10, 11], [-2.0, -2.0, -2.0], reward=1.0),
            TrainSample([5, 6, 7, 8], [12, 13, 14], [-2.0, -2.0, -2.0], reward=0.0),
        ]
    )
    grpo_train_step(trainer, [group])
    folder = scratch / f"{name}-step-000001"
    trainer.save_checkpoint(folder, step=1, metrics={})
    files = sizes(folder)
    total = sum(files.values())
    state = sum(files.get(name, 0) for name in STATE_FILES)
    adapter = files["adapter_model.safetensors"]
    trainable = sum(p.numel() for p in trainer.trainable_parameters)
    print(
        f"{name}: {trainable:,} LoRA parameters; adapter {adapter:,} B, optimizer {files['optimizer.pt']:,} B, "
        f"rng {files['rng_state.pt']:,} B, other {total - adapter - state:,} B; "
        f"per step before {total:,} B, after (adapter only) {total - state:,} B: "
        f"x{total / (total - state):.2f} less disk for every checkpoint but each run's latest"
    )
    del trainer, base
    started = time.perf_counter()
    base, tokenizer = load_base_model(source, cache_dir, dtype=torch.float32)
    merged = merge_adapter(base, folder)
    out = scratch / f"{name}-merged"
    card = model_card(
        title=name, base_model=name, step=1, kind="merged", lora={}, run_config={}, metrics={}, evaluations=[]
    )
    save_merged(merged, tokenizer, out, card=card)
    export_seconds = time.perf_counter() - started
    merged_bytes = sum(sizes(out).values())
    print(
        f"{name}: merged export {export_seconds:.2f} s ({merged_bytes:,} B written) vs loading the base "
        f"model alone {load_seconds:.2f} s: x{export_seconds / load_seconds:.2f}"
    )
    shutil.rmtree(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=["tiny", "bundled"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--cache-dir", default="data/models", help="where the bundled model's conversion is cached"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        for name in args.models:
            if name == "tiny":
                measure("tiny", str(build_tiny_model(scratch / "tiny-base")), scratch, scratch)
            else:
                measure("bundled", BUNDLED_MODEL, Path(args.cache_dir), scratch)


if __name__ == "__main__":
    main()
