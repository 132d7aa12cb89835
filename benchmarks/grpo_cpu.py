"""CPU benchmark: our GRPO step against TRL's GRPOTrainer, and batched against one-at-a-time rollouts.

A script, not a timed test: CPU timings on shared machines are too noisy to assert on. One run
measures, side by side, on the same base model (bundled SmolLM2-135M-Instruct, fp32, CPU), the
same task rows in the same order, the same group size, max new tokens, LoRA and reward:

1. rollout throughput: our TransformersEngine sampling one group in one batched call (KV cache),
   against the same engine called once per completion, and against plain `model.generate`
   one sequence at a time (and batched, the path TRL takes);
2. our training core (load_base_model, Policy, grpo_train_step, TransformersEngine, rollout_groups, the
   string_check reward) in a loop like training/runs/loop.py without Django or checkpoints;
3. TRL's GRPOTrainer with the settings that mean the same thing (table in benchmarks/README.md);
4. the final policies of both, graded by one evaluation procedure (every task row, same seed).

    .venv-bench/bin/python -m benchmarks.grpo_cpu --steps 5 --json /tmp/grpo-bench.json

TRL is imported only for part 3 and lives in its own environment (benchmarks/requirements.txt);
`--skip-trl` runs the rest in the project's venv.
"""

from __future__ import annotations

import os

# Everything is local: no library may wait on the hub. Set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import contextlib
import importlib.metadata
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from artweb.demo import SYSTEM_PROMPT, TASKS_PATH
from training.base_models import BUNDLED_MODEL, load_base_model
from training.config import SINGLE_UPDATE_RECIPE, LoraSpec, TrainConfig
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import EnvironmentSpec, build_messages
from training.recipes.grpo_update import grpo_train_step
from training.rewards import Sample, build_grader, grade_many, grade_trajectories
from training.rollouts.agent import rollout_groups
from training.rollouts.trajectory import to_train_group
from training.runs.steps import rows_for_step
from training.session.policy import Policy, peft_lora_config

REPO_ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT = EnvironmentSpec(system_prompt=SYSTEM_PROMPT)
# Graders by name (training.rewards specs). contains_answer is the default: 1 when the reply
# contains the row's answer, about 0.35 for the base model; at_most_8_words is the demo's brevity
# reward, which climbs within a few steps, so it tells more about learning in a short run.
REWARDS: dict[str, dict[str, Any]] = {
    "contains_answer": {
        "type": "string_check",
        "name": "contains_answer",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "ilike",
    },
    "at_most_8_words": {
        "type": "regex",
        "name": "at_most_8_words",
        "input": "{{sample.output_text}}",
        "pattern": r"^\W*(?:\S+\s+){0,7}\S+\W*$",
        "flags": ["DOTALL"],
    },
}
GOAL_STEP_RATIO = 0.5  # ours / TRL seconds per step, at most
GOAL_THROUGHPUT_RATIO = 4.0  # batched group / one-at-a-time tokens per second, at least


@dataclass
class Settings:
    model: str
    cache_dir: Path
    steps: int
    groups_per_step: int
    group_size: int
    max_new_tokens: int
    learning_rate: float
    reward: str
    seed: int
    eval_samples: int
    throughput_repeats: int
    profile: bool
    skip_trl: bool
    skip_throughput: bool
    skip_eval: bool
    threads: int | None = None
    json_path: Path | None = None

    @property
    def reward_spec(self) -> dict[str, Any]:
        return REWARDS[self.reward]

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            steps=self.steps,
            groups_per_step=self.groups_per_step,
            group_size=self.group_size,
            max_new_tokens=self.max_new_tokens,
            learning_rate=self.learning_rate,
            **SINGLE_UPDATE_RECIPE,  # TRL's: a constant rate, one optimizer step per step
            temperature=1.0,
            top_p=1.0,
            loss_type="ppo",
            epsilon=0.2,
            normalization="sequence",
            scale_rewards=True,
            kl_coef=0.0,
            max_grad_norm=1.0,
            weight_decay=0.0,
            seed=self.seed,
        )


@dataclass
class TrainResult:
    name: str
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)  # process CPU time, all threads
    rollout_seconds: list[float] = field(default_factory=list)  # generation only
    step_rewards: list[float] = field(default_factory=list)  # mean reward of each step's rollouts
    eval_reward: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step_seconds": self.step_seconds,
            "step_cpu_seconds": self.step_cpu_seconds,
            "rollout_seconds": self.rollout_seconds,
            "step_rewards": self.step_rewards,
            "mean_step_seconds": _mean(self.step_seconds),
            "median_step_seconds": _median(self.step_seconds),
            "mean_step_seconds_after_first": _mean(self.step_seconds[1:]),
            "median_step_cpu_seconds": _median(self.step_cpu_seconds),
            "mean_rollout_seconds": _mean(self.rollout_seconds),
            "final_step_reward": self.step_rewards[-1] if self.step_rewards else None,
            "eval_reward": self.eval_reward,
            **self.notes,
        }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------- tasks and reward
def load_task_rows() -> list[dict[str, Any]]:
    """The demo task set, as training/runs/loop.py sees it: [{"index": i, "data": row}]."""
    lines = [line for line in TASKS_PATH.read_text().splitlines() if line.strip()]
    return [{"index": index, "data": json.loads(line)} for index, line in enumerate(lines)]


def step_rows(rows: list[dict[str, Any]], settings: Settings, step: int) -> list[dict[str, Any]]:
    """The rows of step `step` (1-based): the same on both sides, in the same order."""
    return rows_for_step(rows, seed=settings.seed, step=step, count=settings.groups_per_step)


def load_policy_base(settings: Settings) -> tuple[Any, Any]:
    model, tokenizer = load_base_model(settings.model, settings.cache_dir, dtype=torch.float32)
    return model, tokenizer


# ---------------------------------------------------------------- part 1: rollout throughput
def measure_throughput(policy: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: Settings) -> dict:
    """Completion tokens per second for one group, four ways, on the same prompts and model.

    Tokens are the sampled completion tokens up to and including the stop token; a batched call
    runs until its longest row stops, and that wasted work counts against it, as in training.
    """
    engine = TransformersEngine(policy, tokenizer)
    group, max_new = settings.group_size, settings.max_new_tokens
    stop_ids = sorted(engine.stop_token_ids)
    prompts = [build_messages(row["data"], ENVIRONMENT) for row in rows[: settings.throughput_repeats]]
    totals = {name: [0, 0.0] for name in ("engine_group", "engine_one_by_one", "hf_one_by_one", "hf_group")}

    def hf_generate(prompt_ids: list[int], batch: int, seed: int) -> int:
        input_ids = torch.tensor([prompt_ids] * batch)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = policy.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=max_new,
                eos_token_id=stop_ids,
                pad_token_id=engine.pad_token_id,
                use_cache=True,
            )
        tokens = 0
        for row in out[:, len(prompt_ids) :].tolist():
            ends = [i for i, token in enumerate(row) if token in stop_ids]
            tokens += ends[0] + 1 if ends else len(row)
        return tokens

    policy.eval()
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
    for repeat, messages in enumerate(prompts):
        seed = settings.seed + 1000 * repeat
        prompt_ids = engine.render(messages)

        started = time.perf_counter()
        choices = engine.generate([messages] * group, SamplingParams(max_new_tokens=max_new, seed=seed))
        _add(totals["engine_group"], sum(len(c.token_ids) for c in choices), started)

        started = time.perf_counter()
        tokens = 0
        for index in range(group):
            sampling = SamplingParams(max_new_tokens=max_new, seed=seed + index)
            tokens += len(engine.generate([messages], sampling)[0].token_ids)
        _add(totals["engine_one_by_one"], tokens, started)

        started = time.perf_counter()
        tokens = sum(hf_generate(prompt_ids, 1, seed + index) for index in range(group))
        _add(totals["hf_one_by_one"], tokens, started)

        started = time.perf_counter()
        _add(totals["hf_group"], hf_generate(prompt_ids, group, seed), started)

    result = {
        name: {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
        for name, (tokens, seconds) in totals.items()
    }
    result["prompts"] = len(prompts)
    return result


def _add(total: list, tokens: int, started: float) -> None:
    total[0] += tokens
    total[1] += time.perf_counter() - started


# ---------------------------------------------------------------- part 2: our training core
class OurRun:
    """Our training core stepping as training/runs/loop.py does (rollout, grade, update), without
    checkpoints or hooks. Steps are called one at a time so they can interleave with TRL's."""

    def __init__(self, settings: Settings, rows: list[dict[str, Any]]) -> None:
        self.settings, self.rows = settings, rows
        self.config = settings.train_config()
        base_model, tokenizer = load_policy_base(settings)
        self.trainer = Policy(base_model, tokenizer, self.config, LoraSpec(rank=8, alpha=16))
        self.engine = TransformersEngine(self.trainer.policy, tokenizer)
        self.result = TrainResult(name="ours")
        self.result.notes.update({"trainable_tokens": [], "zero_variance_fraction": []})

    def step(self, step: int) -> None:
        config, result = self.config, self.result
        started, cpu_started = time.perf_counter(), time.process_time()
        rows_now = step_rows(self.rows, self.settings, step)
        sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens,
            seed=config.seed * 100_003 + step,
        )
        groups = rollout_groups(
            self.engine, [row["data"] for row in rows_now], ENVIRONMENT, sampling, config.group_size
        )
        rollout_seconds = time.perf_counter() - started
        grade_trajectories(self.settings.reward_spec, groups, rows_now, max_error_fraction=1.0)
        metrics = grpo_train_step(self.trainer, [to_train_group(group) for group in groups])
        result.step_seconds.append(time.perf_counter() - started)
        result.step_cpu_seconds.append(time.process_time() - cpu_started)
        result.rollout_seconds.append(rollout_seconds)
        result.step_rewards.append(metrics["reward_mean"])
        result.notes["trainable_tokens"].append(metrics["trainable_tokens"])
        result.notes["zero_variance_fraction"].append(metrics["zero_variance_fraction"])
        _progress(f"ours step {step}: {result.step_seconds[-1]:.2f}s, reward {metrics['reward_mean']:.3f}")

    def time_checkpoint_save(self) -> None:
        """training/runs/loop.py also saves a checkpoint every step; timed once, apart from s/step."""
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            self.trainer.save_checkpoint(Path(scratch) / "step", step=self.settings.steps, metrics={})
            self.result.notes["checkpoint_seconds"] = time.perf_counter() - started


# ---------------------------------------------------------------- part 3: TRL's GRPOTrainer
def trl_settings_table(settings: Settings) -> list[tuple[str, str, str]]:
    """(our setting, TRL setting, why) for the README and the printed report."""
    batch = settings.groups_per_step * settings.group_size
    return [
        ("group_size", f"num_generations={settings.group_size}", "completions per prompt"),
        (
            "groups_per_step",
            f"per_device_train_batch_size={batch}, gradient_accumulation_steps=1, steps_per_generation=1",
            "TRL counts completions: one optimizer step = one generation batch of "
            f"{settings.groups_per_step} prompts x {settings.group_size}",
        ),
        ("steps", f"max_steps={settings.steps}", "optimizer steps"),
        ("max_new_tokens", f"max_completion_length={settings.max_new_tokens}", ""),
        ("temperature=1, top_p=1", "temperature=1.0, top_p=1.0, top_k=0", "no top-k on either side"),
        (
            "learning_rate",
            f"learning_rate={settings.learning_rate}, lr_scheduler_type=constant",
            "TRL decays",
        ),
        ("AdamW, weight_decay=0", "optim=adamw_torch, weight_decay=0.0", "same betas and eps"),
        ("max_grad_norm=1.0", "max_grad_norm=1.0", ""),
        ("loss_type=ppo, epsilon=0.2", "epsilon=0.2, beta=0.0 (no KL, no reference model)", ""),
        ("normalization=sequence", "loss_type='grpo'", "mean over tokens, then over sequences"),
        (
            "scale_rewards=True",
            "scale_rewards='group'",
            "TRL divides by the unbiased std + 1e-4, ours by the population std + 1e-6",
        ),
        ("(sampler logprobs)", "num_iterations=1", "one update per batch: ratios are 1 on both sides"),
        ("LoRA r=8, alpha=16, 7 proj.", "peft_config=LoraConfig(same)", "same seed, same initial adapter"),
        (
            "fp32, no checkpointing",
            "bf16=False, gradient_checkpointing=False, use_cpu=True",
            "TRL's defaults differ",
        ),
        ("same rows per step", "shuffle_dataset=False over our step rows in order", ""),
        ("(no vLLM)", "use_vllm=False: model.generate with KV cache", "TRL's default path"),
        ("no checkpoints in the timed steps", "save_strategy='no'", "ours: one save timed apart"),
    ]


def train_trl(
    settings: Settings, rows: list[dict[str, Any]], after_each_step: Callable[[int], None]
) -> tuple[TrainResult, Any]:
    """TRL's steps; `after_each_step(n)` runs after TRL's step n, outside its timing."""
    try:
        import trl
        from datasets import Dataset
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        raise SystemExit(
            f"TRL is not installed here ({error}). Use the benchmark environment (see benchmarks/README.md) "
            "or pass --skip-trl."
        ) from None

    config = settings.train_config()
    base_model, tokenizer = load_policy_base(settings)
    records = []
    for step in range(1, settings.steps + 1):
        for row in step_rows(rows, settings, step):
            records.append(
                {
                    "prompt": build_messages(row["data"], ENVIRONMENT),
                    "item": json.dumps(row["data"].get("item", {})),
                }
            )
    grader = build_grader(settings.reward_spec)

    def contains_answer(prompts: list, completions: list, item: list[str], **_: Any) -> list[float]:
        samples = [Sample(output_text=completion[-1]["content"]) for completion in completions]
        return [result.reward for result in grade_many(grader, samples, [json.loads(i) for i in item])]

    result = TrainResult(name=f"trl {trl.__version__}")

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.started, self.cpu_started = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            result.step_seconds.append(time.perf_counter() - self.started)
            result.step_cpu_seconds.append(time.process_time() - self.cpu_started)
            after_each_step(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                result.step_rewards.append(float(logs["reward"]))
                _progress(
                    f"trl step {state.global_step}: {result.step_seconds[-1]:.2f}s, reward {logs['reward']:.3f}"
                )

    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            max_steps=settings.steps,
            per_device_train_batch_size=settings.groups_per_step * settings.group_size,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_generations=settings.group_size,
            num_iterations=1,
            max_completion_length=settings.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=0,
            learning_rate=config.learning_rate,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            beta=config.kl_coef,
            epsilon=config.epsilon,
            loss_type="grpo",
            scale_rewards="group",
            shuffle_dataset=False,
            seed=config.seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_pin_memory=False,
            log_completions=False,
        )
        lora = LoraSpec(rank=8, alpha=16)
        peft_config = peft_lora_config(lora)
        torch.manual_seed(config.seed)  # our Policy seeds the same way before peft draws LoRA A
        trainer = GRPOTrainer(
            model=base_model,
            reward_funcs=[contains_answer],
            args=args,
            train_dataset=Dataset.from_list(records),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[StepTimer()],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; we print our own lines
        _check_same_prompt_tokens(trainer, tokenizer, records[0]["prompt"])
        generate = trainer._generate_single_turn

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                result.rollout_seconds.append(time.perf_counter() - started)

        trainer._generate_single_turn = timed_generate
        trainer.train()
    return result, trainer.model


def _check_same_prompt_tokens(trainer: Any, tokenizer: Any, messages: list[dict]) -> None:
    """TRL renders prompts itself: make sure it feeds the model the tokens our engine does."""
    ours = TransformersEngine(trainer.model, tokenizer).render(messages)
    theirs = list(trainer._tokenize_prompts([messages])[0][0])
    if ours != theirs:
        raise SystemExit(f"prompt tokens differ between our engine and TRL:\n{ours}\n{theirs}")


# ---------------------------------------------------------------- part 4: one evaluation for all
def evaluate(policy: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: Settings) -> float:
    """Mean reward over every task row x eval_samples completions, with one fixed sampling seed, so
    that every policy is graded on the same random numbers."""
    engine = TransformersEngine(policy, tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=settings.max_new_tokens, seed=12345)
    groups = rollout_groups(
        engine, [row["data"] for row in rows], ENVIRONMENT, sampling, settings.eval_samples
    )
    grade_trajectories(settings.reward_spec, groups, rows, max_error_fraction=1.0)
    rewards = [trajectory.reward for group in groups for trajectory in group]
    return statistics.fmean(rewards)


# ---------------------------------------------------------------- profile of our step
def profile_our_step(trainer: Policy, rows: list[dict[str, Any]], settings: Settings) -> dict[str, Any]:
    """One more step of ours under torch.profiler: where rollout and update time goes, by op."""
    from torch.profiler import ProfilerActivity, profile

    config = trainer.config
    engine = TransformersEngine(trainer.policy, trainer.tokenizer)
    rows_now = step_rows(rows, settings, settings.steps + 1)
    sampling = SamplingParams(max_new_tokens=config.max_new_tokens, seed=config.seed * 100_003 + 999)
    report: dict[str, Any] = {}
    with profile(activities=[ProfilerActivity.CPU]) as rollout_profile:
        started = time.perf_counter()
        groups = rollout_groups(
            engine, [row["data"] for row in rows_now], ENVIRONMENT, sampling, config.group_size
        )
        report["rollout_wall_seconds"] = time.perf_counter() - started
    grade_trajectories(settings.reward_spec, groups, rows_now, max_error_fraction=1.0)
    report["rollout_tokens"] = sum(len(t.completion_token_ids) for group in groups for t in group)
    report["rollout_decode_steps"] = max(len(t.completion_token_ids) for group in groups for t in group)
    with profile(activities=[ProfilerActivity.CPU]) as train_profile:
        started = time.perf_counter()
        metrics = grpo_train_step(trainer, [to_train_group(group) for group in groups])
        report["train_wall_seconds"] = time.perf_counter() - started
    report["train_trainable_tokens"] = metrics["trainable_tokens"]
    for name, prof in (("rollout", rollout_profile), ("train", train_profile)):
        averages = prof.key_averages()
        report[f"{name}_table"] = averages.table(sort_by="self_cpu_time_total", row_limit=14)
        report[f"{name}_op_self_seconds"] = sum(a.self_cpu_time_total for a in averages) / 1e6
    return report


# ---------------------------------------------------------------- machine and report
def machine_description() -> dict[str, Any]:
    cpu_model, flags = "unknown", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu_model == "unknown":
                cpu_model = value.strip()
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
    versions = {}
    for package in ("torch", "transformers", "peft", "trl", "accelerate", "datasets"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {
        "cpu_model": cpu_model,
        "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma"}),
        "cores_online": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "versions": versions,
    }


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print("\n== machine")
    print(f"CPU {machine['cpu_model']} ({', '.join(machine['cpu_flags'])})")
    print(
        f"cores online {machine['cores_online']}, usable {machine['cores_usable']}; torch threads "
        f"{machine['torch_threads']} (interop {machine['torch_interop_threads']}); python {machine['python']}"
    )
    print(", ".join(f"{name} {version}" for name, version in machine["versions"].items()))
    print(f"load average at start {report['load_start']}, at end {report['load_end']}")
    settings = report["settings"]
    print(
        f"\nmodel {settings['model']} fp32 CPU; reward {settings['reward']}; {settings['steps']} steps x {settings['groups_per_step']} prompts"
        f" x group {settings['group_size']}; max new tokens {settings['max_new_tokens']}; lr {settings['learning_rate']}"
    )

    throughput = report.get("throughput")
    if throughput:
        print(
            f"\n== rollout throughput (one group of {settings['group_size']}, {throughput['prompts']} prompts)"
        )
        print(f"{'method':<48} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
        labels = {
            "engine_group": "our engine, group batched (KV cache)",
            "engine_one_by_one": "our engine, one sequence per call",
            "hf_one_by_one": "plain model.generate, one sequence per call",
            "hf_group": "plain model.generate, group batched (TRL's path)",
        }
        for key, label in labels.items():
            row = throughput[key]
            print(f"{label:<48} {row['tokens']:>7} {row['seconds']:>8.2f} {row['tokens_per_second']:>7.1f}")

    runs = [run for run in (report.get("ours"), report.get("trl")) if run]
    if runs:
        print(f"\n== training steps (reward {settings['reward']})")
        print(
            f"{'trainer':<11} {'s/step median':>13} {'mean':>6} {'mean 2..N':>9} {'cpu s median':>12} "
            f"{'gen s':>6}  {'reward per step':<30} {'eval':>6}"
        )
        for run in runs:
            per_step = " ".join(f"{r:.2f}" for r in run["step_rewards"])
            print(
                f"{run['name']:<11} {_fmt(run['median_step_seconds']):>13} {_fmt(run['mean_step_seconds']):>6} "
                f"{_fmt(run['mean_step_seconds_after_first']):>9} {_fmt(run['median_step_cpu_seconds']):>12} "
                f"{_fmt(run['mean_rollout_seconds']):>6}  {per_step:<30} {_fmt(run['eval_reward'], 3):>6}"
            )
        print("(gen s: mean seconds generating per step; eval: mean reward of the final policy over every")
        print(f" task row x {settings['eval_samples']} samples, one sampling seed for all policies)")
        if report.get("base_eval_reward") is not None:
            print(f"base model (untrained adapter) eval reward {report['base_eval_reward']:.3f}")
        if report.get("ours"):
            print(f"ours: one checkpoint save (not in s/step) {report['ours']['checkpoint_seconds']:.2f}s")
    if report.get("trl_settings"):
        print("\n== what TRL setting stands for what")
        for ours_name, trl_name, why in report["trl_settings"]:
            print(f"{ours_name:<34} -> {trl_name}" + (f"  ({why})" if why else ""))

    print("\n== ratios")
    for line in report["ratios"]:
        print(line)

    profile_report = report.get("profile")
    if profile_report:
        print("\n== profile of one more step of ours (torch.profiler, self CPU time by op)")
        for name in ("rollout", "train"):
            wall = profile_report[f"{name}_wall_seconds"]
            ops = profile_report[f"{name}_op_self_seconds"]
            print(f"-- {name}: wall {wall:.2f}s, time inside torch ops {ops:.2f}s ({ops / wall:.0%})")
            print(profile_report[f"{name}_table"])


def ratio_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    ours, trl = report.get("ours"), report.get("trl")
    if ours and trl:
        ratio = ours["median_step_seconds"] / trl["median_step_seconds"]
        report["step_ratio"] = ratio
        verdict = "met" if ratio <= GOAL_STEP_RATIO else "MISSED"
        lines.append(
            f"s/step ours / TRL (medians): {ratio:.2f}x  (goal <= {GOAL_STEP_RATIO}x: {verdict}; "
            f"means {ours['mean_step_seconds'] / trl['mean_step_seconds']:.2f}x; CPU-time medians "
            f"{ours['median_step_cpu_seconds'] / trl['median_step_cpu_seconds']:.2f}x)"
        )
        if ours["eval_reward"] is not None and trl["eval_reward"] is not None:
            verdict = "met" if ours["eval_reward"] >= trl["eval_reward"] else "MISSED"
            lines.append(
                f"final eval reward ours {ours['eval_reward']:.3f} vs TRL {trl['eval_reward']:.3f} (goal >=: {verdict})"
            )
    throughput = report.get("throughput")
    if throughput:
        group = throughput["engine_group"]["tokens_per_second"]
        one = throughput["engine_one_by_one"]["tokens_per_second"]
        hf_one = throughput["hf_one_by_one"]["tokens_per_second"]
        report["throughput_ratio"] = group / one
        verdict = "met" if group / one >= GOAL_THROUGHPUT_RATIO else "MISSED"
        lines.append(
            f"rollout tok/s, group batched / one-by-one (same engine): {group / one:.2f}x "
            f"(goal >= {GOAL_THROUGHPUT_RATIO}x: {verdict}); vs plain model.generate one-by-one {group / hf_one:.2f}x"
        )
    return lines or ["(nothing to compare)"]


# ---------------------------------------------------------------- main
def run(settings: Settings) -> dict[str, Any]:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    rows = load_task_rows()
    report: dict[str, Any] = {
        "machine": machine_description(),
        "load_start": load_average(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
    }
    if not settings.skip_throughput:
        # On a live PeftModel with a fresh adapter: what rollouts run on during training.
        _progress("rollout throughput")
        base_model, tokenizer = load_policy_base(settings)
        scratch = Policy(base_model, tokenizer, settings.train_config(), LoraSpec(rank=8, alpha=16))
        report["throughput"] = measure_throughput(scratch.policy, tokenizer, rows, settings)
        del scratch, base_model

    ours = OurRun(settings, rows)
    if settings.skip_trl:
        _progress("our training core")
        for step in range(1, settings.steps + 1):
            ours.step(step)
    else:
        # Step n of ours runs right after step n of TRL's, so both see the same load from
        # whatever else shares the machine.
        _progress("TRL's GRPOTrainer and our training core, steps interleaved")
        theirs, trl_policy = train_trl(settings, rows, after_each_step=ours.step)
    ours.time_checkpoint_save()
    if not settings.skip_eval:
        _progress("evaluating our final policy")
        ours.result.eval_reward = evaluate(ours.trainer.policy, ours.trainer.tokenizer, rows, settings)
        with ours.trainer.policy.disable_adapter():
            _progress("evaluating the base model (adapter off)")
            report["base_eval_reward"] = evaluate(ours.trainer.policy, ours.trainer.tokenizer, rows, settings)
    report["ours"] = ours.result.summary()
    if not settings.skip_trl:
        if not settings.skip_eval:
            _progress("evaluating TRL's final policy")
            theirs.eval_reward = evaluate(trl_policy, ours.trainer.tokenizer, rows, settings)
        report["trl"] = theirs.summary()
        report["trl_settings"] = trl_settings_table(settings)
        del trl_policy

    if settings.profile:
        _progress("profiling one more step of ours")
        report["profile"] = profile_our_step(ours.trainer, rows, settings)
    report["load_end"] = load_average()
    report["ratios"] = ratio_lines(report)
    return report


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=BUNDLED_MODEL, help="BUNDLED_MODEL or a local HF model directory")
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "data" / "models")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups-per-step", type=int, default=2, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--reward", choices=sorted(REWARDS), default="contains_answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-samples", type=int, default=8, help="completions per task row in the final eval"
    )
    parser.add_argument("--throughput-repeats", type=int, default=2, help="prompts timed for throughput")
    parser.add_argument("--profile", action="store_true", help="profile one extra step of ours")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: torch's, one per core); 1 is steadier under load",
    )
    parser.add_argument("--json", dest="json_path", type=Path, help="also write the full report here")
    return Settings(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    settings = parse_args(argv)
    report = run(settings)
    print_report(report)
    if settings.json_path:
        settings.json_path.write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
