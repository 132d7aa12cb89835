"""A GRPO update through the training session core against the same update at a reference commit,
in one run, interleaved: what the session's layer (datums, named loss, optim_step) costs.

    .venv/bin/python -m benchmarks.session_step --ref 2e51007 --repeats 5 --threads 1

The reference commit is checked out into a temporary git worktree and imported by a child process
(``PYTHONPATH`` = the worktree; this file runs there as a script, so it need not exist at the ref); both sides build the same samples (one step of ``grpo_cpu.py``'s
shape: 2 prompts of ~30 tokens x 8 completions of 8-32 tokens, LoRA r=8 on the seven projections,
fp32, on the bundled model or ``--tiny``) and time the GRPO step (``grpo_train_step``; ``Trainer.train_step``
at a reference from before it) after one warm-up step.
Prints seconds per update (median), the ratio session / reference, and the largest difference of
the losses and gradient norms the two report (the same math: float rounding only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def one_side(args: argparse.Namespace) -> dict:
    """Run in this process: build the model and samples, time ``repeats`` updates."""
    import torch

    torch.set_num_threads(args.threads)
    from training.base_models import BUNDLED_MODEL, build_tiny_model, load_base_model
    from training.config import SINGLE_UPDATE_RECIPE, LoraSpec, TrainConfig

    try:
        from training.recipes.grpo_update import grpo_train_step
        from training.rollouts.trajectory import TrainGroup, TrainSample
        from training.session.policy import Policy

        new_policy: Any = Policy
        train_step: Any = grpo_train_step
    except ImportError:  # a reference from before GRPO's step became a function over a policy
        try:
            from training.recipes.grpo_trainer import Trainer  # type: ignore[import-not-found]

            from training.rollouts.trajectory import TrainGroup, TrainSample
        except ImportError:  # a reference from before training/ was laid out by role (2026-12-06)
            from training.trainer import Trainer  # type: ignore[no-redef]
            from training.trajectory import TrainGroup, TrainSample  # type: ignore[no-redef]
        new_policy, train_step = Trainer, Trainer.train_step

    cache = Path(args.cache)
    source = str(build_tiny_model(cache / "tiny")) if args.tiny else BUNDLED_MODEL
    model, tokenizer = load_base_model(source, cache)
    generator = torch.Generator().manual_seed(0)
    vocabulary = int(model.config.vocab_size)
    groups = []
    for _ in range(2):
        prompt = torch.randint(10, vocabulary, (30,), generator=generator).tolist()
        samples = []
        for index in range(8):
            length = int(torch.randint(8, 33, (1,), generator=generator))
            samples.append(TrainSample(prompt_token_ids=prompt,
                                       completion_token_ids=torch.randint(10, vocabulary, (length,), generator=generator).tolist(),
                                       completion_logprobs=[-2.0] * length, reward=float(index % 3)))  # fmt: skip
        groups.append(TrainGroup(samples=samples))
    config = TrainConfig(learning_rate=2e-4, groups_per_step=2, group_size=8, **SINGLE_UPDATE_RECIPE)
    trainer = new_policy(model, tokenizer, config, LoraSpec(rank=8, alpha=16))
    train_step(trainer, groups)  # warm-up
    seconds, losses, norms = [], [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        metrics = train_step(trainer, groups)
        seconds.append(time.perf_counter() - started)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    return {"seconds": seconds, "losses": losses, "grad_norms": norms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the reference commit (before the session core)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny random model instead of the bundled one"
    )
    parser.add_argument("--cache", default=str(ROOT / "data" / "models"))
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # a child: print one side
    args = parser.parse_args()
    if args.side:
        print("SIDE " + json.dumps(one_side(args)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        worktree = Path(scratch) / "ref"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.ref],
                       check=True, capture_output=True)  # fmt: skip
        try:
            results: dict[str, list[dict]] = {"session": [], "reference": []}
            flags = ["--ref", args.ref, "--repeats", str(args.repeats), "--threads", str(args.threads),
                     "--cache", args.cache, "--side", *(["--tiny"] if args.tiny else [])]  # fmt: skip
            for _ in range(2):  # interleaved: each side twice, so both see the same load
                for name, path in (("reference", worktree), ("session", ROOT)):
                    env = {**os.environ, "PYTHONPATH": str(path)}
                    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flags], cwd=path,
                                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
                    line = next(text for text in done.stdout.splitlines() if text.startswith("SIDE "))
                    results[name].append(json.loads(line.removeprefix("SIDE ")))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False
            )
    median = {
        name: statistics.median(s for run in runs for s in run["seconds"]) for name, runs in results.items()
    }
    loss_diff = max(abs(a - b) for x, y in zip(results["session"], results["reference"], strict=True)
                    for a, b in zip(x["losses"], y["losses"], strict=True))  # fmt: skip
    norm_diff = max(abs(a - b) for x, y in zip(results["session"], results["reference"], strict=True)
                    for a, b in zip(x["grad_norms"], y["grad_norms"], strict=True))  # fmt: skip
    print(f"reference ({args.ref}): {median['reference']:.3f} s per update (median)")
    print(f"session core:        {median['session']:.3f} s per update (median)")
    print(f"ratio session / reference: {median['session'] / median['reference']:.3f}")
    print(f"largest difference: loss {loss_diff:.2e}, grad norm {norm_diff:.2e}")


if __name__ == "__main__":
    main()
