"""Decode roofline: how close our decode loop (training.engines.decode.DecodeBatch) gets to the
machine's memory bandwidth, on the bundled SmolLM2-135M-Instruct in fp32 on CPU.

A script, not a timed test. In one process it measures:

1. memory bandwidth (best of several copies of a 512 MiB tensor: bytes read + written per second)
   and fp32 matmul GFLOP/s (2048 × 2048);
2. our decode at batch 1, 8 and 32 (distinct prompts, `--new-tokens` tokens, temperature 1): tokens
   per second, decode steps per second, and achieved bytes/s = weight bytes read per decode step ×
   decode steps per second (each step reads every weight once, whatever the batch; the KV cache
   is small next to 540 MB of weights and is not counted) ÷ the measured bandwidth;
3. the references in the same run: our decode with the model's own linears (`pack_weights=False`:
   no prepacked oneDNN weights, see training/engines/packed.py), printed as packed ÷ unpacked
   decode steps/s; transformers' `model.generate` with the same prompts and settings (left-padded
   static batch, KV cache, sampling; it runs the model's own linears too), printed as ours ÷
   reference;
4. the sampler alone (batch 8 × vocabulary): ours against the one it replaced (log_softmax +
   torch.multinomial, and a full sort for top-p);
5. a GRPO group (8 rows, one prompt): prefill shared once against once per row.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.decode_roofline
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import subprocess
import time
from pathlib import Path

import torch

from training.base_models import BUNDLED_MODEL, load_base_model
from training.engines.base import SamplingParams
from training.engines.decode import DecodeBatch
from training.engines.packed import packed_linears
from training.engines.sampling import sample_tokens, uniform_draws
from training.engines.transformers_engine import TransformersEngine

REPO_ROOT = Path(__file__).resolve().parent.parent
GOAL_ROOFLINE_FRACTION = 0.40  # at batch 8
TOPICS = [
    "the sea", "a lighthouse keeper", "autumn in a small town", "a robot learning to paint",
    "the history of bread", "a long train journey", "a city at night", "a garden in spring",
]  # fmt: skip


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth() -> float:
    """Bytes per second of a large copy (read + write), best of several."""
    source = torch.rand(128 * 2**20)  # 512 MiB of fp32
    target = torch.empty_like(source)
    seconds = best_seconds(lambda: target.copy_(source), 5)
    return 2 * source.numel() * source.element_size() / seconds


def matmul_flops() -> float:
    a, b = torch.rand(2048, 2048), torch.rand(2048, 2048)
    seconds = best_seconds(lambda: a @ b, 5)
    return 2 * 2048**3 / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied embedding counts once: read by the head)."""
    seen = {}
    for parameter in model.parameters():
        seen[parameter.data_ptr()] = parameter.numel() * parameter.element_size()
    return sum(seen.values())


def prompts_for(engine: TransformersEngine, batch: int) -> list[list[int]]:
    return [
        engine.render(
            [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} ({i})."}]
        )
        for i in range(batch)
    ]


def fastest(runs: list[dict]) -> dict:
    return min(runs, key=lambda run: run["seconds"])


def ours(engine: TransformersEngine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    batch = DecodeBatch(engine, None)
    batch.add(prompts, sampling)
    tokens = steps = 0
    decode_seconds = 0.0
    start = time.perf_counter()
    first = True
    while batch.live:
        step_start = time.perf_counter()
        finished = batch.step()
        if not first:  # the first step is the prefill
            decode_seconds += time.perf_counter() - step_start
            steps += 1
        first = False
        tokens += sum(len(choice.token_ids) for _, choice in finished)
    return {
        "seconds": time.perf_counter() - start,
        "tokens": tokens,
        "decode_steps": steps,
        "decode_seconds": decode_seconds,
        "row_steps": batch.forward_rows,
    }


def reference(engine: TransformersEngine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    """transformers' generate on a left-padded static batch (rows that end keep their slot)."""
    model, pad = engine.model, engine.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(sampling.seed or 0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=sorted(engine.stop_token_ids),
        )
    seconds = time.perf_counter() - start
    new = out[:, width:]
    tokens = 0
    for row in new.tolist():
        for token in row:
            tokens += 1
            if token in engine.stop_token_ids:
                break
    return {"seconds": seconds, "tokens": tokens, "decode_steps": new.shape[1] - 1}


def sampler_seconds(vocabulary: int, top_p: float) -> tuple[float, float]:
    """(ours, the replaced sampler) seconds per call at batch 8."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, vocabulary, generator=generator) * 3

    def new() -> None:
        sample_tokens(logits, [0.7] * 8, [top_p] * 8, uniform_draws(8, generator, torch.device("cpu")))

    def old() -> None:
        logprobs = torch.log_softmax(logits / 0.7, dim=-1)
        probs = logprobs.exp()
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=generator)
        logprobs.gather(-1, tokens)

    return best_seconds(new, 20), best_seconds(old, 20)


def shared_prefill_seconds(engine: TransformersEngine) -> tuple[float, float]:
    prompt = engine.render(
        [
            {"role": "system", "content": "You are a helpful assistant. " * 12},
            {"role": "user", "content": "Hi!"},
        ]
    )

    def prefill(share: bool) -> None:
        batch = DecodeBatch(engine, None, share_prompts=share)
        batch.add([prompt] * 8, SamplingParams(max_new_tokens=1, seed=0))
        batch.step()

    return best_seconds(lambda: prefill(True), 3), best_seconds(lambda: prefill(False), 3)


def linears_alone_seconds(engine: TransformersEngine, rows: int) -> float:
    """One decode step's linears alone (every packed linear of the model, in layer order, on a
    [rows, 1, width] input; nothing else of the forward): the bound our forward cannot beat
    while it reads its weights through these kernels."""
    assert engine.linear_packs is not None
    groups = engine.linear_packs.groups(engine.model)
    inputs = {}
    for group in groups:
        width = group[0].weight.shape[1]
        inputs.setdefault(width, torch.randn(rows, 1, width, dtype=group[0].weight.dtype))

    def sweep() -> None:
        for group in groups:
            group[0](inputs[group[0].weight.shape[1]])  # the first member computes the group's

    with torch.no_grad(), packed_linears(engine.model, engine.linear_packs):
        return best_seconds(sweep, 5)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "data" / "models")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the model's weights (training uses fp32 on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each; the fastest counts")
    args = parser.parse_args()

    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT
    )
    print(f"commit {commit.stdout.strip()}, torch threads {threads}, load average {os.getloadavg()}")

    bandwidth = memory_bandwidth()
    flops = matmul_flops()
    print(
        f"memory bandwidth {bandwidth / 1e9:.2f} GB/s (copy), matmul {flops / 1e9:.1f} GFLOP/s (fp32 2048^3)"
    )

    model, tokenizer = load_base_model(BUNDLED_MODEL, args.cache_dir, dtype=getattr(torch, args.dtype))
    engine = TransformersEngine(model.eval(), tokenizer)
    unpacked = TransformersEngine(model, tokenizer, pack_weights=False)
    print(f"linears through prepacked oneDNN weights: {engine.linear_packs is not None}")
    weights = weight_bytes(model)
    print(f"weights {weights / 1e6:.0f} MB; roofline {bandwidth / weights:.1f} decode steps/s")
    engine.generate_from_tokens(prompts_for(engine, 1), SamplingParams(max_new_tokens=4, seed=0))  # warm-up

    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    # The roofline table: no row stops early (stop tokens off in both), so both do the same work.
    stop_token_ids, eos = engine.stop_token_ids, model.generation_config.eos_token_id
    engine.stop_token_ids, model.generation_config.eos_token_id = frozenset(), None
    unpacked.stop_token_ids = frozenset()
    print(f"fixed length: {args.new_tokens} new tokens per row, temperature 1, no early stop")
    print(
        f"{'batch':>5} {'tok/s':>7} {'decode steps/s':>14} {'of roofline':>11}"
        f" {'unpacked steps/s':>16} {'packed/unpacked':>15} {'ref tok/s':>9} {'ours/ref':>8}"
    )
    for size in args.batches:
        prompts = prompts_for(engine, size)
        mine_runs, their_runs, plain_runs = [], [], []
        for _ in range(args.repeats):  # interleaved, best of each: the machine's load drifts
            mine_runs.append(ours(engine, prompts, sampling))
            plain_runs.append(ours(unpacked, prompts, sampling))
            if not args.no_reference:
                their_runs.append(reference(engine, prompts, sampling))
        mine = fastest(mine_runs)
        steps_per_s = mine["decode_steps"] / mine["decode_seconds"]
        plain = min(plain_runs, key=lambda run: run["decode_seconds"])
        plain_steps_per_s = plain["decode_steps"] / plain["decode_seconds"]
        line = (
            f"{size:>5} {mine['tokens'] / mine['seconds']:>7.2f} {steps_per_s:>14.2f}"
            f" {weights * steps_per_s / bandwidth:>11.1%} {plain_steps_per_s:>16.2f}"
            f" {steps_per_s / plain_steps_per_s:>14.2f}x"
        )
        if not args.no_reference:
            theirs = fastest(their_runs)
            assert theirs["tokens"] == mine["tokens"] == size * args.new_tokens
            line += (
                f" {theirs['tokens'] / theirs['seconds']:>9.2f} {theirs['seconds'] / mine['seconds']:>7.2f}x"
            )
        print(line, flush=True)
    engine.stop_token_ids, model.generation_config.eos_token_id = stop_token_ids, eos

    # With stops: finished rows leave our batch; the static batch keeps them to its longest row.
    size = 8
    prompts = [engine.render([{"role": "user", "content": f"Name a colour ({i})."}]) for i in range(size)]
    stopping = SamplingParams(temperature=1.0, max_new_tokens=2 * args.new_tokens, seed=0)
    mine_runs, their_runs = [], []
    for _ in range(args.repeats):
        mine_runs.append(ours(engine, prompts, stopping))
        if not args.no_reference:
            their_runs.append(reference(engine, prompts, stopping))
    mine = fastest(mine_runs)
    line = (
        f"with stops, batch {size}, up to {stopping.max_new_tokens} tokens: ours {mine['tokens']} tokens in"
        f" {mine['seconds']:.1f} s, {mine['row_steps']} row-forwards (static batch:"
        f" {size * (mine['decode_steps'] + 1)})"
    )
    if not args.no_reference:
        theirs = fastest(their_runs)
        line += f"; reference {theirs['tokens']} tokens in {theirs['seconds']:.1f} s"
    print(line, flush=True)
    if engine.linear_packs is not None:
        for size in args.batches:
            seconds = linears_alone_seconds(engine, size)
            print(
                f"linears alone, batch {size}: {seconds * 1e3:.1f} ms a step = {1 / seconds:.1f} steps/s,"
                f" {weights / seconds / bandwidth:.1%} of the roofline (the bound for this forward)"
            )
    vocabulary = model.get_output_embeddings().weight.shape[0]
    for top_p in (1.0, 0.9):
        new, old = sampler_seconds(vocabulary, top_p)
        print(
            f"sampler, batch 8 × {vocabulary}, top_p {top_p}: ours {new * 1e3:.2f} ms, replaced {old * 1e3:.2f} ms ({old / new:.1f}x)"
        )
    shared, per_row = shared_prefill_seconds(engine)
    print(
        f"prefill of a group of 8 (one prompt): shared {shared * 1e3:.0f} ms, per row {per_row * 1e3:.0f} ms ({per_row / shared:.1f}x)"
    )
    print(
        f"goal: >= {GOAL_ROOFLINE_FRACTION:.0%} of the roofline at batch 8; load average after {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
