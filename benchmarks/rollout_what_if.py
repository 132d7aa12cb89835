"""What-if timings for our rollouts: changes the engine does not have (yet), measured here first.

    .venv-bench/bin/python -m benchmarks.rollout_what_if --threads 1

For three training steps' rollouts (2 prompts x 8 completions, 32 new tokens, fresh LoRA):
- "as is": TransformersEngine.generate;
- "merged LoRA": the same call between peft's merge_adapter() and unmerge_adapter();
- "pruned rows": a copy of the engine's sampling loop in which rows that stopped leave the
  batch (their KV-cache rows are dropped). Its samples differ from "as is" after the first
  pruning (fewer rows draw from the generator), so compare tok/s, not seconds;
and, on one [16, vocabulary] probability matrix, torch.multinomial against inverse-CDF sampling.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from benchmarks.grpo_cpu import (
    ENVIRONMENT,
    LoraSpec,
    SamplingParams,
    TransformersEngine,
    build_messages,
    load_policy_base,
    load_task_rows,
    parse_args,
    step_rows,
)
from training.engines.transformers_engine import sample_next_token
from training.session.policy import Policy


def pruned_generate(engine: TransformersEngine, requests: list[list[dict]], sampling: SamplingParams) -> int:
    """The engine's loop (temperature 1, no stop strings) with finished rows pruned; returns tokens."""
    policy = engine.model
    prompts = [engine.render(messages) for messages in requests]
    batch, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), engine.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    generator = torch.Generator().manual_seed(sampling.seed or 0)
    active, produced = list(range(batch)), 0
    policy.eval()
    with torch.no_grad():
        out = policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        cache, logits, next_position = out.past_key_values, out.logits[:, -1, :], position_ids[:, -1:] + 1
        for step in range(sampling.max_new_tokens):
            tokens, _ = sample_next_token(logits, 1.0, 1.0, generator)
            produced += len(active)
            keep = [i for i in range(len(active)) if int(tokens[i]) not in engine.stop_token_ids]
            if not keep or step == sampling.max_new_tokens - 1:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep)
                cache.reorder_cache(index)
                attention_mask, next_position, tokens = (
                    attention_mask[index],
                    next_position[index],
                    tokens[index],
                )
                active = [active[i] for i in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=-1)
            out = policy(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position,
                use_cache=True,
                past_key_values=cache,
            )
            cache, logits, next_position = out.past_key_values, out.logits[:, -1, :], next_position + 1
    return produced


def sampling_costs(vocabulary: int, rows: int = 16, repeats: int = 30) -> dict[str, float]:
    """Milliseconds per call: torch.multinomial vs searchsorted over the cumulative probabilities."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(rows, vocabulary) * 3, dim=-1)

    def inverse_cdf() -> torch.Tensor:
        cumulative = probs.cumsum(-1)
        draws = torch.rand(rows, 1, generator=generator) * cumulative[:, -1:]
        return torch.searchsorted(cumulative, draws).clamp(max=vocabulary - 1)

    costs = {}
    for name, sample in (
        ("multinomial", lambda: torch.multinomial(probs, 1, generator=generator)),
        ("inverse CDF", inverse_cdf),
    ):
        sample()
        started = time.perf_counter()
        for _ in range(repeats):
            sample()
        costs[name] = (time.perf_counter() - started) / repeats * 1e3
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = parse_args([])
    model, tokenizer = load_policy_base(settings)
    policy = Policy(model, tokenizer, settings.train_config(), LoraSpec(rank=8, alpha=16)).policy
    engine = TransformersEngine(policy, tokenizer)
    rows = load_task_rows()

    def merged(requests: list[list[dict]], sampling: SamplingParams) -> Any:
        policy.merge_adapter()
        try:
            return engine.generate(requests, sampling)
        finally:
            policy.unmerge_adapter()

    totals = {name: [0, 0, 0.0] for name in ("as is", "merged LoRA", "pruned rows")}  # tokens, row-steps, s
    for step in range(1, args.steps + 1):
        requests = [
            build_messages(row["data"], ENVIRONMENT)
            for row in step_rows(rows, settings, step)
            for _ in range(settings.group_size)
        ]
        sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, seed=step)
        for name, generate in (("as is", engine.generate), ("merged LoRA", merged)):
            started = time.perf_counter()
            choices = generate(requests, sampling)
            totals[name][2] += time.perf_counter() - started
            totals[name][0] += sum(len(choice.token_ids) for choice in choices)
            totals[name][1] += len(requests) * max(len(choice.token_ids) for choice in choices)
        started = time.perf_counter()
        tokens = pruned_generate(engine, requests, sampling)
        totals["pruned rows"][2] += time.perf_counter() - started
        totals["pruned rows"][0] += tokens
        totals["pruned rows"][1] += tokens
    print(f"torch threads {torch.get_num_threads()}")
    for name, (tokens, row_steps, seconds) in totals.items():
        print(
            f"{name:<12} tokens {tokens:5d}  row-steps computed {row_steps:5d}  "
            f"seconds {seconds:6.2f}  tok/s {tokens / seconds:6.1f}"
        )
    vocabulary = policy.get_base_model().config.vocab_size
    for name, milliseconds in sampling_costs(vocabulary).items():
        print(f"sampling one token for 16 rows over {vocabulary} tokens, {name}: {milliseconds:.2f} ms")


if __name__ == "__main__":
    main()
