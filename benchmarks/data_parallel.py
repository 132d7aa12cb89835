"""A data-parallel update (training.hosting.ranks, 2 gloo ranks) against one process on the same batch.

Prints the largest difference between the two sides' LoRA weights after --steps AdamW steps, the
losses of each step, and the seconds per step of each side, measured inside the processes (process
start and the group's rendezvous excluded). Both sides start from the same adapter (rank 0's init
is broadcast) and see the same batch: --rows GRPO-like rows of --tokens tokens, the `ppo` loss
(GRPO runs) or `--loss cross_entropy` (the update of SFT runs, and of DPO runs with per-datum weights).

On this 2-core CPU the two ranks get one core each and the single process both: two ranks are not
a speed-up here, only the equality is the point. On GPUs each rank has its own device.

    python -m benchmarks.data_parallel            # the bundled SmolLM2-135M
    python -m benchmarks.data_parallel --tiny
    python -m benchmarks.data_parallel --pool     # a Tinker client's session (training.hosting.pool)
    python -m benchmarks.data_parallel --fsdp     # the base sharded across the ranks (FSDP2)

``--fsdp``: the ranks shard the frozen base (training.hosting.ranks.shard_base); the report adds the
parameter bytes each rank holds at rest against one process's.

``--pool``: a SessionPool session opened with ``devices: 2`` (rank 0 in this process, a follower
process for rank 1) against one with ``devices: 1``, called as a Tinker client calls it (two
``forward_backward`` calls of half the rows each, then ``optim_step``, per step): what the mirroring
(each call pickled down a pipe, the results gathered) costs on top of the update itself.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def batch(rows: int, tokens: int, vocab: int, seed: int = 0) -> list[Any]:
    from training.session.contract import Datum

    rng = random.Random(seed)
    data = []
    for row in range(rows):
        length = rng.randint(tokens // 2, tokens)
        ids = [rng.randrange(10, vocab) for _ in range(length)]
        prompt = length // 3
        data.append(Datum(model_input=ids[:-1], loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * prompt + [1.0] * (length - 1 - prompt),
            "logprobs": [-2.0] * (length - 1),
            "advantages": [1.0 if row % 2 else -1.0] * (length - 1),
        }))  # fmt: skip
    return data


def session(source: str, cache: Path, threads: int) -> Any:
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.local import TrainingSession
    from training.session.policy import Policy

    torch.set_num_threads(threads)
    model, tokenizer = load_base_model(source, cache, device="cpu")
    return TrainingSession(Policy(model, tokenizer, TrainConfig(seed=7), LoraSpec()))


def train(target: Any, data: list[Any], steps: int, learning_rate: float, loss: str) -> dict[str, Any]:
    """``steps`` updates on ``data``; the gradient of the first (summed over ranks when parallel)."""
    losses, seconds, first_grads = [], [], []
    single = getattr(target, "session", target)  # the rank's own TrainingSession
    params = single.trainer.trainable_parameters
    for step in range(steps):
        started = time.perf_counter()
        losses.append(target.forward_backward(data, loss).loss)
        if target is not single:
            target.reduce_gradients()
        if step == 0:
            first_grads = [p.grad.detach().clone() for p in params]
        single.optim_step(learning_rate=learning_rate)
        seconds.append(time.perf_counter() - started)
    return {"losses": losses, "seconds": seconds, "params": [p.detach().clone() for p in params],
            "first_grads": first_grads}  # fmt: skip


def _rank(rank: int, world_size: int, source: str, cache: str, out: str, rows: int, tokens: int,
          steps: int, learning_rate: float, loss: str, fsdp: bool) -> None:  # fmt: skip
    from training.hosting.ranks import DataParallelSession, local_parameter_bytes

    parallel = DataParallelSession(session(source, Path(cache), threads=1), shard=fsdp)
    vocab = len(parallel.session.trainer.tokenizer)
    result = train(parallel, batch(rows, tokens, vocab), steps, learning_rate, loss)
    result["parameter_bytes"] = local_parameter_bytes(parallel.session.trainer.model)
    torch.save(result, Path(out) / f"rank-{rank}.pt")


def pool_side(source: str, cache: Path, work: Path, devices: int, data: list[Any], steps: int,
              learning_rate: float, loss: str) -> dict[str, Any]:  # fmt: skip
    """A Tinker client's calls on a pool session with ``devices`` ranks."""
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.hosting.pool import SessionPool

    def load(name: str) -> tuple[Any, Any]:
        model, tokenizer = load_base_model(name, cache, device="cpu")
        return model, tokenizer

    pool = SessionPool(load, spill_dir=work / f"spill-{devices}", model_cache_dir=cache)
    started = time.perf_counter()
    pool.open("client", source, TrainConfig(seed=7, devices=devices), LoraSpec())
    opened = time.perf_counter() - started
    half = len(data) // 2
    losses, seconds = [], []
    try:
        with pool.use("client") as client:
            for _ in range(steps):
                started = time.perf_counter()
                loss_sum = client.forward_backward(data[:half], loss).loss
                loss_sum += client.forward_backward(data[half:], loss).loss
                client.optim_step(learning_rate=learning_rate)
                seconds.append(time.perf_counter() - started)
                losses.append(loss_sum)
            params = [p.detach().clone() for p in client.trainer.trainable_parameters]
    finally:
        pool.close("client")
    return {"open_seconds": opened, "losses": losses, "seconds": seconds, "params": params}


def pool_main(args: Any, source: str, cache: Path, work: Path) -> dict[str, Any]:
    torch.set_num_threads(2)
    from training.base_models import load_tokenizer

    data = batch(args.rows, args.tokens, len(load_tokenizer(source, cache)))
    common = (data, args.steps, args.learning_rate, args.loss)
    one = pool_side(source, cache, work, 1, *common)
    # Rank 0 keeps this process's 2 threads, as a trainer service's does; the follower takes 1.
    os.environ["TORCH_THREADS"] = "1"
    two = pool_side(source, cache, work, 2, *common)
    later = slice(1, None) if args.steps > 1 else slice(None)
    return {
        "model": source, "rows": args.rows, "tokens": args.tokens, "steps": args.steps, "loss": args.loss,
        "max_weight_difference": max(float((a - b).abs().max()) for a, b in zip(two["params"], one["params"], strict=True)),
        "max_weight_change": max(float(p.abs().max()) for p in one["params"]),
        "losses_two_devices": two["losses"], "losses_one_device": one["losses"],
        "open_seconds_two_devices": round(two["open_seconds"], 2), "open_seconds_one_device": round(one["open_seconds"], 2),
        "seconds_per_step_two_devices": two["seconds"], "seconds_per_step_one_device": one["seconds"],
        "time_ratio_two_devices_over_one": round(sum(two["seconds"][later]) / sum(one["seconds"][later]), 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--loss", default="ppo", choices=["ppo", "cross_entropy"])
    parser.add_argument("--pool", action="store_true", help="a Tinker client's pool session (see above)")
    parser.add_argument("--fsdp", action="store_true", help="shard the base across the ranks (see above)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    from training.base_models import BUNDLED_MODEL, build_tiny_model
    from training.hosting.ranks import local_parameter_bytes, run_ranks

    work = Path(tempfile.mkdtemp(prefix="artweb-ddp-bench-"))
    cache = work / "models"
    source = str(build_tiny_model(work / "tiny")) if args.tiny else BUNDLED_MODEL
    common = (args.rows, args.tokens, args.steps, args.learning_rate, args.loss)
    from training.base_models import base_model_dir

    base_model_dir(source, cache)  # the bundled model converted once, before two ranks read it
    if args.pool:
        report = pool_main(args, source, cache, work)
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return
    run_ranks(_rank, 2, source, str(cache), str(work), *common, args.fsdp, rendezvous=work / "rendezvous")
    one = session(source, cache, threads=2)
    vocab = len(one.trainer.tokenizer)
    single = train(one, batch(args.rows, args.tokens, vocab), args.steps, args.learning_rate, args.loss)
    ranks = [torch.load(work / f"rank-{rank}.pt") for rank in (0, 1)]
    report = {
        "model": source,
        "rows": args.rows,
        "tokens": args.tokens,
        "steps": args.steps,
        "loss": args.loss,
        "fsdp": args.fsdp,
        "parameter_bytes_per_rank": [rank["parameter_bytes"] for rank in ranks],
        "parameter_bytes_single": local_parameter_bytes(one.trainer.model),
        "ranks_identical": all(
            torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True)
        ),
        "max_weight_difference": max(
            float((a - b).abs().max()) for a, b in zip(ranks[0]["params"], single["params"], strict=True)
        ),
        "max_weight_change": max(float(p.abs().max()) for p in single["params"]),
        # The summed gradient against one process's, relative to its norm (the claim itself;
        # AdamW then divides by sqrt(v), which magnifies differences where a gradient is ~0).
        "first_gradient_relative_difference": float(
            torch.cat(
                [
                    (a - b).reshape(-1)
                    for a, b in zip(ranks[0]["first_grads"], single["first_grads"], strict=True)
                ]
            ).norm()
            / torch.cat([b.reshape(-1) for b in single["first_grads"]]).norm()
        ),
        "losses_two_ranks": ranks[0]["losses"],
        "losses_single": single["losses"],
        "seconds_per_step_two_ranks": ranks[0]["seconds"],
        "seconds_per_step_single": single["seconds"],
    }
    later = slice(1, None) if args.steps > 1 else slice(None)  # the first step carries warm-up
    ratio = sum(ranks[0]["seconds"][later]) / sum(single["seconds"][later])
    report["time_ratio_two_ranks_over_single"] = round(ratio, 2)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
