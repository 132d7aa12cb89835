"""Which recipe learns in the fewest steps? The defaults before 2026-12-05 (TRL's recipe: a constant
learning rate, one update per step), each lever alone, their combinations and the defaults chosen
from them (``new_defaults``: TrainConfig's own, the learning rate from the base model's width),
against TRL's GRPOTrainer, at equal batch shape.

In-sample: the current defaults were chosen on these very tasks and seeds (``bold``,
``arithmetic``, ``tools``, seeds 0 to 2, one run each), so how the defaults compare here says how
well they fit these task-seeds, not how they do on a task or seed they were not chosen on.

A script, not a timed test. Every configuration trains the bundled SmolLM2-135M-Instruct through the
platform's own ``training.runs.loop.run_training`` (in-memory hooks, no Django) for ``--steps`` steps of
``--groups-per-step`` rows × ``--group-size`` completions, LoRA r8, and is evaluated greedily on the
task's held-out rows after every step (the loop's own evaluation). TRL (run in the same script, same
rows, same prompts, same reward, same LoRA) is evaluated the same way after steps 3, 6 and 12. The
report gives, per task and configuration: held-out reward at steps 3, 6 and 12, the first step whose
held-out reward reaches TRL's 12-step figure, rollouts drawn, and seconds per step.

    .venv-bench/bin/python -m benchmarks.sample_efficiency --tasks bold arithmetic \
        --json /tmp/sample_efficiency.json
    .venv/bin/python -m benchmarks.sample_efficiency --skip-trl --configs defaults combined

Tasks (written for this benchmark; rows are generated or read from artweb/demo):
- ``bold``: the demo's one-word questions, the answer in bold (``**word**``); reward 0.5 for a bold
  span anywhere + 0.5 for a correct answer anywhere. Asked to, the bundled model bolds now and then
  (2 replies of 64 at temperature 1), rarely enough that the format is learnt, not given.
- ``format``: the same questions answered as ``Answer: <word>``; reward 0.5 for the format (the
  whole reply) + 0.5 for a correct answer anywhere in it. Kept for the tables that used it, but no
  format task: the bundled model never writes "Answer:" (0 of 64 samples, 0 of a run's 192), so
  its format half pays nobody, and it measures only drift in the answers' correctness (a held-out
  row of 24 either way).
- ``arithmetic``: "What is 7 plus 5?" over small numbers (seeded); reward ``correct · (0.5 + 0.5 ·
  bare)`` as in the demo: the right number as a word, and the bare number for full marks.
- ``tools``: artweb/demo/tool_tasks.jsonl in the ``python_tools`` environment (a ``lookup`` tool,
  two turns); the ladder reward of benchmarks/env_proof.py. Slow on CPU (long prompts, two turns)
  and TRL has no multi-turn tool loop here: it is compared among our configurations only.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from artweb.demo import TASKS_PATH
from benchmarks.demo_learning import MemoryHooks
from training.base_models import BUNDLED_MODEL
from training.config import SINGLE_UPDATE_RECIPE, LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
EVAL_AT = (3, 6, 12)

# Every configuration starts from TRL's recipe (the defaults before 2026-12-05): ``--learning-rate``
# constant, one optimizer step per step; a configuration overrides some of it.
BEFORE = SINGLE_UPDATE_RECIPE
# TrainConfig's defaults since (chosen from the rows of benchmarks/README.md: `lean` on the
# bundled model, and since a later session `lean_epochs1`, two passes on the first step); the
# learning rate left empty, so the loop fills it in from the model's width.
NEW_DEFAULTS = {
    name: spec["default"]
    for name, spec in TrainConfig.field_help().items()
    if name in {*BEFORE, "learning_rate"}
}
# The levers, each alone, and the combination (see benchmarks/README.md for what was measured).
SCHEDULE = {"learning_rate": 4e-4, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}
# Compute-neutral: no extra rollouts, no extra passes; the same samples in two optimizer steps on a
# cosine schedule from a higher peak (the demo's).
LEAN = {**SCHEDULE, "learning_rate": 1e-3, "num_minibatches": 2}
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},  # the defaults before 2026-12-05 (BEFORE at --learning-rate)
    "new_defaults": NEW_DEFAULTS,
    "schedule": SCHEDULE,
    "minibatches": {"num_minibatches": 2},
    "epochs": {"ppo_epochs": 2},
    "dynamic": {"dynamic_sampling": True, "max_resample_factor": 2.0},
    "lean": LEAN,
    # `lean` from a higher peak (benchmarks/README.md: 2e-3 reached TRL's 12-step `format` figure at
    # step 5, then fell back on `arithmetic` and was slower on `tools`).
    "lean_2e3": {**LEAN, "learning_rate": 2e-3},
    "lean_1.5e3": {**LEAN, "learning_rate": 1.5e-3},
    # `lean` with one more lever each: dynamic sampling (rare successes kept in the batch), a second
    # pass over the batch, and as many optimizer steps as that from one pass (four minibatches).
    "lean_dynamic": {**LEAN, "dynamic_sampling": True, "max_resample_factor": 2.0},
    "lean_epochs": {**LEAN, "ppo_epochs": 2},
    "lean_mb4": {**LEAN, "num_minibatches": 4},
    # Two passes on the first 1 / 2 / 3 / 6 steps only (early_ppo_epochs), where successes are rarest.
    **{f"lean_epochs{n}": {**LEAN, "early_ppo_epochs": 2, "early_ppo_epochs_steps": n} for n in (1, 2, 3, 6)},
    # DAPO's soft length penalty from half the budget on (a turn past 8 of 16 new tokens loses up to
    # 1 reward by 16), alone and on top of `lean`.
    "length": {"length_penalty_buffer": 8},
    "lean_length": {**LEAN, "length_penalty_buffer": 8},
    "combined": {
        **SCHEDULE,
        "num_minibatches": 2,
        "ppo_epochs": 2,
        "dynamic_sampling": True,
        "max_resample_factor": 2.0,
    },  # fmt: skip
}

FORMAT_PROMPT = "Reply in the form Answer: <one word>."
# An accepted answer (the row's ``accept`` alternation) anywhere in the reply, as a whole word.
ACCEPTED_ANSWER = {
    "type": "regex",
    "input": "{{sample.output_text}}",
    "pattern": r"\b(?:{{item.accept}})\b",
    "flags": ["IGNORECASE"],
}
FORMAT_REWARD = {
    "type": "multi",
    "name": "format_and_correct",
    "graders": {
        "format": {
            "type": "regex",
            "input": "{{sample.output_text}}",
            "pattern": r"\s*Answer:\s*\S+\s*",
            "mode": "fullmatch",
        },  # fmt: skip
        "correct": ACCEPTED_ANSWER,
    },
    "calculate_output": "0.5 * format + 0.5 * correct",
}
# A format the bundled model samples now and then (2 replies of 64 at temperature 1 on the training
# questions, 2026-12-05), so GRPO has something to reinforce: `format`'s "Answer: <word>" was
# sampled in none of 64, nor in any of the 192 rollouts of a 12-step run, so that task's format
# half paid 0 to every recipe, TRL's included, and it measured drift in correctness alone.
BOLD_PROMPT = "Reply with the answer in bold, like **word**."
BOLD_REWARD = {
    "type": "multi",
    "name": "bold_and_correct",
    "graders": {
        "bold": {"type": "regex", "input": "{{sample.output_text}}", "pattern": r"\*\*[^*\n]+\*\*"},
        "correct": ACCEPTED_ANSWER,
    },
    "calculate_output": "0.5 * bold + 0.5 * correct",
}
ARITHMETIC_PROMPT = "Answer with the number only."
ARITHMETIC_REWARD = {
    "type": "multi",
    "name": "correct_and_bare",
    "graders": {
        "correct": {"type": "regex", "input": "{{sample.output_text}}", "pattern": r"\b{{item.answer}}\b"},
        "bare": {
            "type": "regex",
            "input": "{{sample.output_text}}",
            "pattern": r"\W*{{item.answer}}\W*",
            "mode": "fullmatch",
        },  # fmt: skip
    },
    "calculate_output": "correct * (0.5 + 0.5 * bare)",
}


def _split(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    train: list[dict[str, Any]] = []
    validation: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        row = dict(row)
        split = row.pop("split", "train")
        (validation if split == "validation" else train).append({"index": index, "data": row})
    return train, validation


def arithmetic_rows(seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for index in range(64):
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        word, value = rng.choice([("plus", a + b), ("times", a * b), ("minus", max(a, b) - min(a, b))])
        a, b = (max(a, b), min(a, b)) if word == "minus" else (a, b)
        rows.append({"prompt": f"What is {a} {word} {b}?", "item": {"answer": str(value)},
                     "split": "validation" if index % 4 == 0 else "train"})  # fmt: skip
    return rows


def task(name: str) -> dict[str, Any]:
    """Rows (train, validation), environment factory, reward, sampling settings of a task."""
    if name in ("format", "bold"):
        rows = [json.loads(line) for line in TASKS_PATH.read_text().splitlines() if line.strip()]
        train, validation = _split(rows)
        prompt, reward = (FORMAT_PROMPT, FORMAT_REWARD) if name == "format" else (BOLD_PROMPT, BOLD_REWARD)
        return {"train": train, "validation": validation, "reward": reward, "max_new_tokens": 16,
                "environment": lambda: build_environment("chat", system_prompt=prompt), "system_prompt": prompt}  # fmt: skip
    if name == "arithmetic":
        train, validation = _split(arithmetic_rows())
        return {"train": train, "validation": validation, "reward": ARITHMETIC_REWARD, "max_new_tokens": 16,
                "environment": lambda: build_environment("chat", system_prompt=ARITHMETIC_PROMPT),
                "system_prompt": ARITHMETIC_PROMPT}  # fmt: skip
    if name == "tools":
        from benchmarks.env_proof import TOOL_REWARD, TOOL_SYSTEM_PROMPT, TOOL_TASKS

        rows = [json.loads(line) for line in TOOL_TASKS.read_text().splitlines() if line.strip()]
        train, validation = _split(rows)
        return {"train": train, "validation": validation, "reward": TOOL_REWARD, "max_new_tokens": 32,
                "environment": lambda: build_environment("python_tools", tools=["lookup"], max_turns=2,
                                                         system_prompt=TOOL_SYSTEM_PROMPT),
                "system_prompt": None}  # fmt: skip
    raise SystemExit(f"unknown task {name!r}")


def base_config(arguments: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "steps": arguments.steps,
        "groups_per_step": arguments.groups_per_step,
        "group_size": arguments.group_size,
        "learning_rate": arguments.learning_rate,
        **BEFORE,
        "max_new_tokens": settings["max_new_tokens"],
        "temperature": 1.0,
        "seed": arguments.seed,
        "eval_interval": 1,
        "eval_max_rows": len(settings["validation"]),
        "eval_temperature": 0.0,
    }


def ours(
    name: str, overrides: dict[str, Any], settings: dict[str, Any], arguments: argparse.Namespace
) -> dict:
    config = TrainConfig.from_dict({**base_config(arguments, settings), **overrides})
    spec = RunSpec.resolving(
        base_model_source=arguments.model,
        model_cache_dir=arguments.cache_dir,
        checkpoint_root=Path(tempfile.mkdtemp(prefix=f"sample-efficiency-{name}-")),
        config=config,
        lora=LoraSpec(rank=8, alpha=16),
        environment=settings["environment"](),
        grader_spec=settings["reward"],
        train_rows=settings["train"],
        validation_rows=settings["validation"],
        start_step=0,
        resume_step=None,
    )
    hooks = StepHooks()
    started = time.monotonic()
    run_training(spec, hooks)
    return {
        "held_out": {step: hooks.evaluations[step]["reward_mean"] for step in sorted(hooks.evaluations)},
        "held_out_graders": {
            step: {name: round(value, 3) for name, value in hooks.evaluations[step]["grader_means"].items()}
            for step in sorted(hooks.evaluations)
        },
        "train_reward": [round(row["reward_mean"], 3) for row in hooks.steps],
        "zero_variance": [row["zero_variance_fraction"] for row in hooks.steps],
        "rollouts": sum(hooks.rollouts),
        "step_seconds": statistics.fmean(hooks.seconds),
        "seconds": round(time.monotonic() - started, 1),
    }


class StepHooks(MemoryHooks):
    """MemoryHooks that also count each step's rollouts and seconds, quietly."""

    def __init__(self) -> None:
        super().__init__(echo=False)
        self.rollouts: list[int] = []
        self.seconds: list[float] = []

    def record_step(self, *, step, metrics, trajectories, path) -> bool:  # type: ignore[no-untyped-def]
        self.rollouts.append(len(trajectories))
        self.seconds.append(float(metrics.get("step_seconds", 0.0)))
        return super().record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)


def trl(settings: dict[str, Any], arguments: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same rows in the same order (training.runs.loop.rows_for_step), the same
    prompts (system prompt + row), reward, LoRA and batch shape; held-out reward (our evaluation
    procedure, greedy) after steps 3, 6 and 12."""
    import trl as trl_package
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from training.base_models import load_base_model
    from training.engines.base import SamplingParams
    from training.engines.transformers_engine import TransformersEngine
    from training.environments import EnvironmentSpec, build_messages
    from training.rewards import Sample, build_grader, grade_many
    from training.runs.evaluation import LocalPolicy, evaluate
    from training.runs.steps import rows_for_step
    from training.session.policy import peft_lora_config

    config = TrainConfig.from_dict(base_config(arguments, settings))
    environment = EnvironmentSpec(system_prompt=settings["system_prompt"])
    records = []
    for step in range(1, config.steps + 1):
        for row in rows_for_step(
            settings["train"], seed=config.seed, step=step, count=config.groups_per_step
        ):
            records.append({"prompt": build_messages(row["data"], environment),
                            "item": json.dumps(row["data"].get("item", {}))})  # fmt: skip
    grader = build_grader(settings["reward"])

    def reward(prompts: list, completions: list, item: list[str], **_: Any) -> list[float]:
        samples = [Sample(output_text=completion[-1]["content"]) for completion in completions]
        return [result.reward for result in grade_many(grader, samples, [json.loads(i) for i in item])]

    base, tokenizer = load_base_model(arguments.model, arguments.cache_dir, dtype=torch.float32)
    held_out: dict[int, float] = {}
    seconds: list[float] = []
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=config.max_new_tokens,
                              seed=config.seed * 100_003 + 99_991)  # fmt: skip

    def measure(model: Any, step: int) -> None:
        engine = TransformersEngine(model, tokenizer)
        with settings["environment"]() as env:
            result = evaluate(LocalPolicy(engine=engine, sampling=sampling), settings["validation"], env,
                              settings["reward"])  # fmt: skip
        held_out[step] = result.results["reward_mean"]

    class Hooks(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
            seconds.append(time.perf_counter() - self.started)
            if state.global_step in EVAL_AT:
                was_training = model.training
                model.eval()
                measure(model, state.global_step)
                model.train(was_training)

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, max_steps=config.steps,
            per_device_train_batch_size=config.groups_per_step * config.group_size, gradient_accumulation_steps=1,
            steps_per_generation=1, num_generations=config.group_size, num_iterations=1,
            max_completion_length=config.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=config.learning_rate, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
            weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
            shuffle_dataset=False, seed=config.seed, logging_steps=1, save_strategy="no", report_to="none",
            disable_tqdm=True, dataloader_pin_memory=False, log_completions=False,
        )  # fmt: skip
        torch.manual_seed(config.seed)
        trainer = GRPOTrainer(model=base, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(records),
                              processing_class=tokenizer, peft_config=peft_lora_config(LoraSpec(rank=8, alpha=16)),
                              callbacks=[Hooks()])  # fmt: skip
        trainer.remove_callback(PrinterCallback)
        measure(trainer.model, 0)
        trainer.train()
    return {
        "name": f"trl {trl_package.__version__}",
        "held_out": held_out,
        "rollouts": config.steps * config.groups_per_step * config.group_size,
        "step_seconds": statistics.fmean(seconds),
        "seconds": round(time.monotonic() - started, 1),
    }


def steps_to_reach(held_out: dict[int, float], target: float | None) -> int | None:
    if target is None:
        return None
    reached = [step for step, value in sorted(held_out.items()) if step > 0 and value >= target - 1e-9]
    return reached[0] if reached else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["bold", "arithmetic"],
        choices=["bold", "format", "arithmetic", "tools"],
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "data" / "models")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    report: dict[str, Any] = {"arguments": {k: str(v) for k, v in vars(arguments).items()}, "configs": CONFIGS,
                              "tasks": {}}  # fmt: skip
    for name in arguments.tasks:
        settings = task(name)
        results: dict[str, Any] = {}
        if not arguments.skip_trl and name != "tools":
            results["trl"] = trl(settings, arguments)
            print(json.dumps({"task": name, "trl": results["trl"]}), flush=True)
        target = results.get("trl", {}).get("held_out", {}).get(arguments.steps)
        for config in arguments.configs:
            outcome = ours(config, CONFIGS[config], settings, arguments)
            outcome["steps_to_trl"] = steps_to_reach(outcome["held_out"], target)
            results[config] = outcome
            print(json.dumps({"task": name, "config": config, **outcome}), flush=True)
        report["tasks"][name] = results
        if arguments.json:
            arguments.json.write_text(json.dumps(report, indent=2))
    print_table(report)
    return report


def print_table(report: dict[str, Any]) -> None:
    for name, results in report["tasks"].items():
        target = results.get("trl", {}).get("held_out", {})
        print(f"\n{name}: held-out reward (greedy) at steps 0/3/6/12; TRL at 12: {target.get(12, 'n/a')}")
        print(
            f"{'config':<12} {'step0':>6} {'step3':>6} {'step6':>6} {'step12':>6} {'to TRL':>7} {'rollouts':>8} {'s/step':>7}"
        )
        for config, outcome in results.items():
            held = {int(k): v for k, v in outcome["held_out"].items()}
            cells = [f"{held[s]:.3f}" if s in held else "-" for s in (0, *EVAL_AT)]
            reach = outcome.get("steps_to_trl", "-")
            print(f"{config:<12} {cells[0]:>6} {cells[1]:>6} {cells[2]:>6} {cells[3]:>6} {reach if reach is not None else 'never':>7} "
                  f"{outcome['rollouts']:>8} {outcome['step_seconds']:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
