"""What constrained decoding (response_format, training/engines/grammar.py) costs per token: the
same batch sampled by TransformersEngine with no grammar, with RULER's reply schema and with
`json_object`, interleaved in one run, as seconds per decoding step (a batched call's wall time
over its longest row's tokens) and their ratio to the unconstrained run; plus the mask alone
(computing and applying each row's mask and advancing its matcher, replayed over the sampled
tokens, no model), the one-off cost of building the tokenizer's view and of compiling the schema.

    .venv/bin/python -m benchmarks.bench_grammar [--model DIR] [--batch 8] [--max-new-tokens 64]
        [--repeats 5] [--threads 1] [--json out.json]

Without --model it runs on the bundled SmolLM2-135M-Instruct (converted into --cache-dir on first
use, ~30 s). A script, not a timed test: timings on shared machines are too noisy to assert on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from training.engines.base import SamplingParams
from training.engines.grammar import GrammarCompiler, json_grammar
from training.engines.transformers_engine import TransformersEngine
from training.rewards.ruler import scores_response_format

PROMPT = [
    {"role": "system", "content": "You are a judge. Reply with JSON only."},
    {"role": "user", "content": "Score each of four answers to 'What is the capital of France?' from 0 to 1: "
                                "1: Paris. 2: Lyon. 3: Paris, I think. 4: I do not know."},
]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local HF model directory (default: the bundled model)")
    parser.add_argument("--cache-dir", default="data/models", help="where the bundled model is converted")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from training.base_models import BUNDLED_MODEL, load_base_model

    model, tokenizer = load_base_model(args.model or BUNDLED_MODEL, Path(args.cache_dir))
    engine = TransformersEngine(model, tokenizer)
    started = time.perf_counter()
    compiler = engine.grammars
    tokenizer_s = time.perf_counter() - started
    schema = scores_response_format(4)["json_schema"]["schema"]
    started = time.perf_counter()
    grammar = json_grammar(schema)
    engine.check_grammar(grammar)
    compile_ms = (time.perf_counter() - started) * 1000
    variants: dict[str, str | None] = {
        "unconstrained": None,
        "json_schema": grammar,
        "json_object": json_grammar(None),
    }
    # No stop tokens: every row runs max_new_tokens steps unless its grammar completes (RULER's open
    # explanation rarely does within 64), so the variants are timed over the same positions; a
    # step costs more as the KV cache grows, and a run that stops early would look cheaper.
    engine.stop_token_ids = frozenset()

    prompts = [engine.render(PROMPT)] * args.batch
    runs: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {name: [] for name in variants}
    steps_seen: dict[str, list[int]] = {name: [] for name in variants}
    samples: dict[str, list[list[int]]] = {}
    engine.generate_from_tokens(prompts[:1], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    for repeat in range(args.repeats):
        for name, variant in variants.items():  # interleaved: all three see the same machine load
            sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=repeat)
            grammars = None if variant is None else [variant] * args.batch
            started = time.perf_counter()
            choices = engine.generate_from_tokens(prompts, sampling, grammars=grammars)
            elapsed = time.perf_counter() - started
            steps = max(len(choice.token_ids) for choice in choices)
            runs[name].append(elapsed / steps)
            steps_seen[name].append(steps)
            tokens[name].append(sum(len(choice.token_ids) for choice in choices))
            samples[name] = [choice.token_ids for choice in choices]

    base = statistics.median(runs["unconstrained"])
    report: dict[str, Any] = {
        "model": args.model or BUNDLED_MODEL,
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "tokenizer_view_s": round(tokenizer_s, 3),
        "schema_compile_ms": round(compile_ms, 2),
        "vocab": compiler.vocab_size,
    }
    for name in variants:
        median = statistics.median(runs[name])
        report[name] = {
            "ms_per_step": round(median * 1000, 3),
            "ratio": round(median / base, 3),
            "tokens_per_run": statistics.median(tokens[name]),
            "steps_per_run": statistics.median(steps_seen[name]),
        }
    report["mask_alone_us_per_token"] = {
        name: round(_mask_alone(compiler, variants[name], samples[name], engine) * 1e6, 1)
        for name in ("json_schema", "json_object")
    }
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def _mask_alone(
    compiler: GrammarCompiler, grammar: str | None, sampled: list[list[int]], engine: Any
) -> float:
    """Seconds per token of the grammar work of one batch step (mask, apply, advance), replayed
    over tokens the engine sampled under that grammar, on logits of the model's width."""
    assert grammar is not None
    width = engine.grammars.vocab_size
    matchers = compiler.matchers([grammar] * len(sampled))
    logits = torch.randn(len(sampled), width)
    done = [False] * len(sampled)
    seconds, count = 0.0, 0
    for step in range(max(len(tokens) for tokens in sampled)):
        started = time.perf_counter()
        matchers.mask_logits(logits, done)
        for row, tokens in enumerate(sampled):
            if not done[row]:
                if step == len(tokens) - 1 or matchers.advance(row, tokens[step]):
                    done[row] = True
                count += 1
        seconds += time.perf_counter() - started
    return seconds / max(count, 1)


def _print(report: dict[str, Any]) -> None:
    print(f"model {report['model']}, batch {report['batch']}, <= {report['max_new_tokens']} new tokens, "
          f"{report['repeats']} repeats, {report['threads']} threads")  # fmt: skip
    print(f"one-off: tokenizer view {report['tokenizer_view_s']} s (vocab {report['vocab']}), "
          f"RULER schema compile {report['schema_compile_ms']} ms")  # fmt: skip
    print("== ms per decoding step (median), ratio to unconstrained")
    for name in ("unconstrained", "json_schema", "json_object"):
        row = report[name]
        print(f"{name:>14}: {row['ms_per_step']:8.2f} ms  x{row['ratio']:.3f}  "
              f"({row['tokens_per_run']} tokens, {row['steps_per_run']} steps per run)")  # fmt: skip
    alone = report["mask_alone_us_per_token"]
    print(
        f"== mask alone: {alone['json_schema']} us/token (json_schema), {alone['json_object']} us/token (json_object)"
    )


if __name__ == "__main__":
    main()
