"""SFT and RL curves of the unmodified ``tinker`` SDK training the bundled model on a live artweb.

``manage.py up`` (SQLite, the filesystem broker or ``--broker``, a Celery worker, the trainer service,
the inference server) runs in a temporary data folder; the SDK drives it through ``/tinker`` with a
team key. Task: the demo's one-word questions (artweb/demo/format_tasks.jsonl; 40 train, 24
validation rows), system prompt "Answer with one word only."

- SFT: ``cross_entropy`` on the bare answer (and its end-of-turn token) after the chat prompt,
  ``--sft-batch`` rows per step; the held-out loss (mean NLL per answer token over the validation
  rows, ``forward``) before training and every ``--eval-every`` steps.
- RL: a fresh LoRA; each step samples ``--group`` answers to each of ``--rl-batch`` training
  questions from the current weights (``save_weights_and_get_sampling_client``), scores them with the
  demo's reward (``correct · (0.5 + 0.5 · exact)``), centres the rewards per question and trains
  ``importance_sampling`` on them; the mean sampled reward per step is the curve.

    .venv/bin/python -m benchmarks.tinker_curves --broker redis://127.0.0.1:6379/14 --json /tmp/tc.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._model import add_model_arguments, prepared_model
from benchmarks.tinker_overhead import _manage, live_stack


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--sft-steps", type=int, default=12)
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--sft-lr", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=10)
    parser.add_argument("--rl-batch", type=int, default=4)
    parser.add_argument("--group", type=int, default=6)
    parser.add_argument("--rl-lr", type=float, default=4e-4)
    parser.add_argument(
        "--broker", default="", help="a Celery broker URL; default: the embedded filesystem broker"
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)

    import tinker
    from tinker import types

    from artweb.demo import REWARD_SPEC, SYSTEM_PROMPT, TASKS_PATH
    from training.base_models import load_tokenizer
    from training.rewards import Sample, build_grader, grade_many

    rows = [json.loads(line) for line in TASKS_PATH.read_text().splitlines() if line.strip()]
    train = [row for row in rows if row.get("split") != "validation"]
    validation = [row for row in rows if row.get("split") == "validation"]
    grader = build_grader(REWARD_SPEC)

    report: dict[str, Any] = {"model": source, "sft": {}, "rl": {}}
    with live_stack(cache, source, args.broker) as (url, env):
        base_name = _manage(env, "from projects.models import BaseModel; print(BaseModel.objects.get().name)")
        key = _manage(env, "from projects import services; from projects.models import Team; "
                      "team, _ = Team.objects.get_or_create(name='bench'); "
                      "print(services.api_key_create(team=team, name='bench').plaintext)")  # fmt: skip
        tokenizer = load_tokenizer(source, cache)
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")

        def prompt_ids(row: dict[str, Any]) -> list[int]:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": row["prompt"]},
            ]
            return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                      return_dict=True)["input_ids"])  # fmt: skip

        def sft_datum(row: dict[str, Any]) -> tuple[Any, int]:
            prompt = prompt_ids(row)
            answer = tokenizer.encode(row["item"]["answer"], add_special_tokens=False) + [end]
            tokens = prompt + answer
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})  # fmt: skip
            return datum, len(answer)

        client = tinker.ServiceClient(base_url=f"{url}/tinker", api_key=f"tml-{key}")

        # ---- SFT
        held = [sft_datum(row) for row in validation]
        held_tokens = sum(n for _, n in held)

        def held_out(trainer: Any) -> float:
            output = trainer.forward([d for d, _ in held], "cross_entropy").result()
            return output.metrics["loss:sum"] / held_tokens

        sft = client.create_lora_training_client(base_model=base_name, rank=8, seed=0).result()
        rng = random.Random(0)
        curve = [(0, held_out(sft))]
        losses, started = [], time.monotonic()
        for step in range(1, args.sft_steps + 1):
            batch = [sft_datum(row) for row in rng.sample(train, args.sft_batch)]
            tokens = sum(n for _, n in batch)
            output = sft.forward_backward([d for d, _ in batch], "cross_entropy").result()
            sft.optim_step(types.AdamParams(learning_rate=args.sft_lr)).result()
            losses.append(output.metrics["loss:sum"] / tokens)
            if step % args.eval_every == 0 or step == args.sft_steps:
                curve.append((step, held_out(sft)))
            print(
                json.dumps({"sft_step": step, "train_loss": round(losses[-1], 4), "held_out": curve[-1]}),
                flush=True,
            )
        report["sft"] = {"held_out": curve, "train_loss": losses, "seconds": round(time.monotonic() - started, 1),
                         "lr": args.sft_lr, "batch": args.sft_batch}  # fmt: skip

        # ---- RL
        rl = client.create_lora_training_client(base_model=base_name, rank=8, seed=1).result()
        params = types.SamplingParams(max_tokens=16, temperature=1.0, stop=[end])
        rewards, started = [], time.monotonic()
        for step in range(1, args.rl_steps + 1):
            policy = rl.save_weights_and_get_sampling_client()
            questions = rng.sample(train, args.rl_batch)
            data, step_rewards = [], []
            for row in questions:
                prompt = prompt_ids(row)
                group = policy.sample(types.ModelInput.from_ints(prompt), num_samples=args.group,
                                      sampling_params=params).result()  # fmt: skip
                texts = [tokenizer.decode([t for t in seq.tokens if t != end]) for seq in group.sequences]
                scores = [r.reward for r in grade_many(grader, [Sample(output_text=t) for t in texts],
                                                       [row["item"]] * len(texts))]  # fmt: skip
                step_rewards += scores
                mean = statistics.mean(scores)
                for seq, score in zip(group.sequences, scores, strict=True):
                    tokens = prompt + list(seq.tokens)
                    n = len(prompt) - 1
                    data.append(types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * n + list(seq.logprobs),
                                        "advantages": [0.0] * n + [score - mean] * len(seq.tokens)},
                    ))  # fmt: skip
            rewards.append(statistics.mean(step_rewards))
            rl.forward_backward(data, "importance_sampling").result()
            rl.optim_step(types.AdamParams(learning_rate=args.rl_lr)).result()
            print(json.dumps({"rl_step": step, "reward": round(rewards[-1], 3)}), flush=True)
        report["rl"] = {"reward": rewards, "seconds": round(time.monotonic() - started, 1), "lr": args.rl_lr,
                        "batch": args.rl_batch, "group": args.group}  # fmt: skip
    sft_curve = report["sft"]["held_out"]
    print(f"== {source}: SFT held-out loss {sft_curve[0][1]:.3f} -> {sft_curve[-1][1]:.3f} "
          f"({args.sft_steps} steps, {report['sft']['seconds']} s)")  # fmt: skip
    rl_curve = report["rl"]["reward"]
    print(f"== RL reward: first 3 steps {statistics.mean(rl_curve[:3]):.3f}, last 3 {statistics.mean(rl_curve[-3:]):.3f}"
          f" ({args.rl_steps} steps, {report['rl']['seconds']} s): {[round(r, 3) for r in rl_curve]}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
