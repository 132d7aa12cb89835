"""The update's forward+backward in four layouts, on the bundled model, in one process.

    .venv/bin/python -m benchmarks.update_packing --threads 1 --repeats 3

The rows are shaped like one step of ``grpo_cpu.py`` (2 prompts of ~30 tokens x 8 completions of
8-32 tokens, LoRA r=8 on the seven projections, fp32); token values are random (the cost does not
depend on them). Layouts:

- padded: today's trainer before packing: one left-padded row per completion, in sampling order;
- padded, length-sorted: the same rows sorted by length (the fallback for flash-attention);
- prefix KV: each group's prompt forward once (with grad), its KV cache repeated to the group,
  the completions right-padded behind it;
- packed: ``training.session.packing`` (the trainer's layout): a prompt once and its completions after it
  in one row, a tree-shaped 4-D mask, no padding (one row per unit, and all units in one row).

Prints s per forward+backward (median of the repeats, layouts interleaved), the positions each
computes, its padding, the ratio to padded, and the largest logprob difference to padded (exact
layouts agree to fp32 rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from training.base_models import BUNDLED_MODEL, load_base_model
from training.config import SINGLE_UPDATE_RECIPE, LoraSpec, TrainConfig
from training.rollouts.trajectory import TrainSample
from training.session.packing import pack
from training.session.policy import Policy


def make_samples(groups: int, group_size: int, prompt_len: int, seed: int) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=generator).tolist()

    samples = []
    for _ in range(groups):
        prompt = tokens(prompt_len + int(torch.randint(-3, 4, (1,), generator=generator)))
        for _ in range(group_size):
            n = int(torch.randint(8, 33, (1,), generator=generator))
            samples.append(TrainSample(prompt, tokens(n), [-2.0] * n, reward=0.0))
    return samples


def padded(trainer: Policy, samples: list[TrainSample], sort: bool) -> tuple[torch.Tensor, int, int]:
    items = [(s, 1.0) for s in samples]
    if sort:
        items.sort(key=lambda item: len(item[0].prompt_token_ids) + len(item[0].completion_token_ids))
    batch = trainer._collate(items)
    logprobs, _ = trainer._completion_logprobs(batch)
    (logprobs * batch["mask"]).sum().backward()
    # back to sampling order, completion tokens left-aligned, for the comparison
    out = torch.zeros(len(samples), 32)
    width = batch["mask"].shape[1]
    order = [samples.index(s) for s, _ in items] if sort else list(range(len(samples)))
    for row, index in enumerate(order):
        n = len(samples[index].completion_token_ids)
        out[index, :n] = logprobs[row, width - n :].detach()
    return out, int(batch["positions"]), int(batch["padding"])


def packed(trainer: Policy, samples: list[TrainSample], row_tokens: int) -> tuple[torch.Tensor, int, int]:
    rows = pack(samples, [1.0] * len(samples), budget=4096, row_tokens=row_tokens)
    out = torch.zeros(len(samples), 32)
    positions = 0
    for row in rows:
        batch = {
            "input_ids": row.input_ids,
            "position_ids": row.position_ids,
            "attention_mask": row.attention_mask,
            "keep": row.keep,
            "logit_index": row.logit_index,
            "targets": row.targets,
        }
        logprobs, _ = trainer._completion_logprobs(batch)
        (logprobs * row.mask).sum().backward()
        positions += row.width
        for r, index in enumerate(row.members):
            n = len(samples[index].completion_token_ids)
            out[index, :n] = logprobs[r, :n].detach()
    return out, positions, 0


def prefix_kv(trainer: Policy, samples: list[TrainSample]) -> tuple[torch.Tensor, int, int]:
    """Prompt once with grad, its cache repeated per completion, completions right-padded."""
    model, temperature = trainer.model, trainer.config.temperature
    out = torch.zeros(len(samples), 32)
    positions = padding = 0
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        by_prompt.setdefault(tuple(sample.prompt_token_ids), []).append(index)
    for prompt, members in by_prompt.items():
        first = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        cache = first.past_key_values
        cache.batch_repeat_interleave(len(members))
        width = max(len(samples[m].completion_token_ids) for m in members)
        ids = torch.zeros((len(members), width), dtype=torch.long)
        attention = torch.zeros((len(members), len(prompt) + width), dtype=torch.long)
        attention[:, : len(prompt)] = 1
        for row, m in enumerate(members):
            completion = samples[m].completion_token_ids
            ids[row, : len(completion)] = torch.tensor(completion)
            attention[row, len(prompt) : len(prompt) + len(completion)] = 1
        position_ids = torch.arange(len(prompt), len(prompt) + width)[None].expand(len(members), -1)
        rest = model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        logits = torch.cat([first.logits.expand(len(members), -1, -1), rest.logits[:, :-1]], dim=1)
        logits = logits.float() / temperature
        logprobs = logits.gather(-1, ids[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        mask = attention[:, len(prompt) :].float()
        (logprobs * mask).sum().backward()
        positions += len(prompt) + len(members) * width
        padding += int((1 - mask).sum())
        for row, m in enumerate(members):
            n = len(samples[m].completion_token_ids)
            out[m, :n] = logprobs[row, :n].detach()
    return out, positions, padding


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=30)
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("ARTWEB_DATA_DIR", "data")) / "models"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_base_model(args.model, args.cache_dir, dtype=torch.float32)
    trainer = Policy(
        model,
        tokenizer,
        TrainConfig(group_size=args.group_size, **SINGLE_UPDATE_RECIPE),
        LoraSpec(rank=8, alpha=16),
    )
    samples = make_samples(args.groups, args.group_size, args.prompt_tokens, seed=0)
    layouts = {
        "padded (before)": lambda: padded(trainer, samples, sort=False),
        "padded, length-sorted": lambda: padded(trainer, samples, sort=True),
        "prefix KV, completions padded": lambda: prefix_kv(trainer, samples),
        "packed, one row per group": lambda: packed(trainer, samples, row_tokens=1),
        "packed, all groups in one row": lambda: packed(trainer, samples, row_tokens=1_000_000),
    }
    times: dict[str, list[float]] = {name: [] for name in layouts}
    results = {}
    with open("/proc/loadavg") as f:
        print(f"load average at start: {' '.join(f.read().split()[:3])}; threads {args.threads}")
    for _ in range(args.repeats + 1):  # the first round warms up and is not counted
        for name, layout in layouts.items():
            trainer.optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            results[name] = layout()
            times[name].append(time.perf_counter() - start)
    reference = results["padded (before)"][0]
    base = statistics.median(times["padded (before)"][1:])
    print(
        f"{'layout':<32} {'s fwd+bwd':>10} {'÷ padded':>9} {'positions':>10} {'padding':>8} {'max |dlogp|':>12}"
    )
    for name in layouts:
        median = statistics.median(times[name][1:])
        logprobs, positions, pad = results[name]
        diff = float((logprobs - reference).abs().max())
        print(
            f"{name:<32} {median:>10.3f} {median / base:>8.2f}x {positions:>10} {pad / positions:>7.1%} {diff:>12.2e}"
        )
    with open("/proc/loadavg") as f:
        print(f"load average at end: {' '.join(f.read().split()[:3])}")


if __name__ == "__main__":
    main()
