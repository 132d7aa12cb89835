"""The training loop of one run, top to bottom: roll out, grade, update, checkpoint, record.

No Django here: the caller passes a ``RunHooks`` object that records results and answers "should
I stop?". Invariants the loop keeps:
- checkpoint files are complete (atomic rename) before ``hooks.record_step`` is called;
- a step is a pure function of (seed, step, checkpoint before it), so a resumed run redoes an
  unrecorded step exactly as the dead worker would have, and never records one twice.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from training.agent import rollout_groups
from training.config import LoraSpec, TrainConfig
from training.cost import device_usage, sampled_tokens
from training.environments import Environment
from training.evaluation import evaluate_during_run, is_evaluation_step
from training.grpo import is_zero_variance
from training.learning_signal import SignalWatch
from training.progress import phase, progress_events, step_label
from training.rewards import grade_trajectories
from training.schedules import learning_rate_at
from training.trajectory import Trajectory, to_train_group

logger = logging.getLogger(__name__)


@dataclass
class RunSpec:
    base_model_source: str  # BUNDLED_MODEL or a local model directory
    model_cache_dir: Path  # where converted base models are cached
    checkpoint_root: Path  # one folder per step: <root>/step-000003
    config: TrainConfig
    lora: LoraSpec
    environment: Environment  # from training.environments.build_environment; run_training closes it
    grader_spec: dict[str, Any]
    train_rows: list[dict[str, Any]]  # each {"index": int, "data": task row}
    start_step: int  # model step this run started from
    resume_step: int | None  # recorded checkpoint to resume from; None = fresh adapter (step 0)
    stop: list[str] = field(default_factory=list)
    max_grader_error_fraction: float = 0.5
    device: str = "cpu"
    engine: str = "auto"  # rollout engine: auto | vllm | transformers (training.engines.select_engine_kind)
    unsloth: str = "auto"  # base model loader: auto | on | off (training.unsloth_loader.use_unsloth)
    reward_name: str = ""  # how users know the reward definition, for error messages
    judge: Any = None  # training.rewards.JudgeClient for LLM-judge graders (the team's endpoint)
    sandbox: Any = None  # training.rewards.SandboxConfig: the operator's python-grader limits
    validation_rows: list[dict[str, Any]] = field(default_factory=list)  # evaluated (training.evaluation)
    objective: str = (
        "grpo"  # grpo (rollouts and rewards) | sft | dpo (training.supervised: rows carry targets)
    )


# A finished step's trajectories as ``hooks.record_step`` gets them: (group_index, task_row_index, trajectory).
StepTrajectories = list[tuple[int, int, Trajectory]]


class RunHooks(Protocol):
    def should_stop(self) -> str | None:
        """A reason to stop before the next step ("cancelled", "lost") or None."""

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None: ...

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        """Persist a finished step (see StepTrajectories); False if this worker lost the run."""

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None: ...

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        """Persist the validation evaluation of checkpoint ``step`` (training.evaluation.EvalSample list)."""

    def is_evaluated(self, *, step: int) -> bool:
        """Whether checkpoint ``step`` has its evaluation recorded (asked only when resuming)."""


def checkpoint_path(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def rows_for_step(
    rows: list[dict[str, Any]], *, seed: int, step: int, count: int, draw: int = 0
) -> list[dict[str, Any]]:
    """The task rows of one step: deterministic in (seed, step), so resuming replays them; ``draw``
    numbers dynamic sampling's further draws within the step (0: the step's first rows)."""
    rng = random.Random(seed * 1_000_003 + step + draw * 998_244_353)
    if count <= len(rows):
        return rng.sample(rows, count)
    return [rng.choice(rows) for _ in range(count)]


def _load_policy_model(spec: RunSpec) -> tuple[Any, Any, Any]:
    return load_policy_model(
        spec.base_model_source, spec.model_cache_dir, device=spec.device, unsloth=spec.unsloth
    )


def load_policy_model(source: str, cache_dir: Path, *, device: str, unsloth: str) -> tuple[Any, Any, Any]:
    """The base model for training, its tokenizer and dtype: unsloth's loader on CUDA when
    installed (``unsloth``: auto | on | off), else transformers."""
    from training.base_models import base_model_dir, load_base_model, resolve_dtype
    from training.unsloth_loader import load_with_unsloth, use_unsloth

    dtype = resolve_dtype("auto", device)
    if use_unsloth(device, unsloth):
        model, tokenizer = load_with_unsloth(
            base_model_dir(source, cache_dir), max_seq_length=4096, dtype=dtype
        )
    else:
        model, tokenizer = load_base_model(source, cache_dir, dtype=dtype, device=device)
    return model, tokenizer, dtype


class _Draw:
    """The rollouts and grades of one step, and dynamic sampling's further draws (DAPO): rows are
    drawn, rolled out and graded until ``groups_per_step`` groups carry a signal (rewards not all
    equal) or ``max_resample_factor × groups_per_step`` rows were drawn. Each draw is deterministic
    in (seed, step, draw), so a resumed step draws the same rows and samples."""

    def __init__(self, spec: RunSpec, sampler: Any, hooks: RunHooks, *, step: int, label: str) -> None:
        self.spec, self.sampler, self.hooks, self.step, self.label = spec, sampler, hooks, step, label
        self.rollout_seconds = 0.0
        self.draws = 0

    def rows(
        self, count: int, *, draw: int
    ) -> tuple[list[list[Trajectory]], list[dict[str, Any]], dict[str, float]]:
        from training.engines.base import SamplingParams

        spec, config, hooks, step = self.spec, self.spec.config, self.hooks, self.step
        self.draws = draw + 1
        rows = rows_for_step(spec.train_rows, seed=config.seed, step=step, count=count, draw=draw)
        sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens,
            stop=spec.stop,
            seed=config.seed * 100_003 + step + draw * 1_000_000_007,
        )
        more = f" (draw {draw + 1})" if draw else ""
        phase(hooks, "rollouts", f"{self.label}: rollouts{more}, {len(rows)} groups × {config.group_size} samples",
              step=step, groups=len(rows))  # fmt: skip
        started = time.monotonic()
        groups = rollout_groups(
            self.sampler.engine,
            [row["data"] for row in rows],
            spec.environment,
            sampling,
            config.group_size,
            adapter=self.sampler.adapter,
            on_progress=progress_events(hooks, "rollouts", f"{self.label}: rollouts", step=step),
        )
        self.rollout_seconds += time.monotonic() - started
        phase(hooks, "grading", f"{self.label}: grading{more}", step=step)
        grading = grade_trajectories(spec.grader_spec, groups, rows, spec.max_grader_error_fraction, spec.reward_name,
                                     judge=spec.judge, sandbox=spec.sandbox)  # fmt: skip
        return groups, rows, grading

    def until_full(
        self, groups: list[list[Trajectory]], rows: list[dict[str, Any]], grading: dict[str, float]
    ) -> tuple[list[list[Trajectory]], list[dict[str, Any]], dict[str, float], list[list[Trajectory]]]:
        """Every group drawn, their rows, the merged grading metrics, and the batch: the first
        ``groups_per_step`` groups with a signal."""
        config = self.spec.config
        wanted = config.groups_per_step
        cap = max(wanted, int(wanted * config.max_resample_factor))
        kept = [group for group in groups if not is_zero_variance([t.reward for t in group])]
        while len(kept) < wanted and len(groups) < cap and self.hooks.should_stop() is None:
            # Enough rows for the rest at the keep rate seen so far (all that are left when none kept).
            need = wanted - len(kept)
            count = cap - len(groups) if not kept else math.ceil(need * len(groups) / len(kept))
            more, more_rows, more_grading = self.rows(min(count, cap - len(groups)), draw=self.draws)
            groups, rows = groups + more, rows + more_rows
            grading = merge_grading(grading, more_grading, len(groups) - len(more), len(more))
            kept += [group for group in more if not is_zero_variance([t.reward for t in group])]
        return groups, rows, grading, kept[:wanted]

    def summary(self, groups: list[list[Trajectory]], batch: list[list[Trajectory]]) -> dict[str, float]:
        """What dynamic sampling did; the reward and zero-variance figures of every group drawn
        (the batch alone holds only groups with a signal)."""
        rewards = [t.reward for group in groups for t in group]
        mean = sum(rewards) / max(len(rewards), 1)
        dropped = sum(1 for group in groups if is_zero_variance([t.reward for t in group]))
        return {
            "groups_drawn": float(len(groups)),
            "groups_dropped": float(dropped),
            "groups_trained": float(len(batch)),
            "sampling_draws": float(self.draws),
            "zero_variance_fraction": dropped / max(len(groups), 1),
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards), 1)),
        }


def merge_grading(
    first: dict[str, float], second: dict[str, float], first_groups: int, second_groups: int
) -> dict[str, float]:
    """Grading metrics of two draws as one: counts add, the error fraction is re-weighted."""
    merged = {key: first.get(key, 0.0) + second.get(key, 0.0) for key in {*first, *second}}
    total = first_groups + second_groups
    merged["grader_error_fraction"] = (
        first.get("grader_error_fraction", 0.0) * first_groups
        + second.get("grader_error_fraction", 0.0) * second_groups
    ) / max(total, 1)
    return merged


class PolicySampler:
    """The rollout engine and the adapter it samples with.

    On CPU (and whenever vLLM is absent) the TransformersEngine samples from the trainer's live
    policy, so there is nothing to load. With vLLM, every saved checkpoint is loaded as a new
    adapter (fresh id: vLLM caches adapters by id) and the previous one is dropped. vLLM shares the
    GPU with the trainer through sleep mode: asleep during the update, woken before the adapter
    of the new checkpoint loads (engines/vllm_engine.py).
    """

    def __init__(self, spec: RunSpec, trainer: Any, tokenizer: Any, dtype: Any, step: int) -> None:
        from training.engines import select_engine_kind

        self.kind = select_engine_kind(spec.device, spec.engine)
        if self.kind == "vllm" and spec.config.top_p < 1:
            # vLLM reports top-p-truncated logprobs, which the trainer cannot reproduce.
            self.kind = "transformers"
        self.adapter: str | None = None
        if self.kind == "vllm":
            from training.base_models import base_model_dir
            from training.engines.vllm_engine import VLLMEngine

            self.engine: Any = VLLMEngine(
                base_model_dir(spec.base_model_source, spec.model_cache_dir),
                tokenizer=tokenizer,
                max_lora_rank=spec.lora.rank,
                dtype=str(dtype).removeprefix("torch."),
                sleep_mode=True,
            )
            self.use_checkpoint(f"step-{step}", checkpoint_path(spec.checkpoint_root, step))
        else:
            from training.engines.transformers_engine import TransformersEngine

            self.engine = TransformersEngine(trainer.policy, tokenizer, device=spec.device)

    def before_update(self) -> None:
        """Give the GPU memory vLLM holds to the policy update."""
        if self.kind == "vllm":
            self.engine.sleep()

    def use_checkpoint(self, name: str, path: Path) -> None:
        if self.kind != "vllm":
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the update's cached blocks, which vLLM's wake-up needs
        self.engine.wake_up()
        previous = self.adapter
        self.engine.load_adapter(name, path)
        self.adapter = name
        if previous is not None:
            self.engine.unload_adapter(previous)


def run_training(spec: RunSpec, hooks: RunHooks) -> str:
    """Train ``spec.config.steps`` steps from ``spec.start_step``; returns "succeeded", "cancelled"
    or "lost" (another worker owns the run now). The environment is closed at the end (an MCP
    session and its server process live as long as the run)."""
    try:
        return _run_training(spec, hooks)
    finally:
        spec.environment.close()


def start_trainer(spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
    """The run's trainer, its tokenizer and dtype, and the step it is at: a fresh adapter saved and
    recorded as the start step's checkpoint, or the checkpoint ``spec.resume_step`` restored."""
    import torch

    from training.trainer import Trainer

    config = spec.config
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    started = time.monotonic()
    phase(hooks, "loading", f"Loading base model {spec.base_model_source}")
    base_model, tokenizer, dtype = _load_policy_model(spec)
    hooks.event(f"Loaded base model {spec.base_model_source} in {time.monotonic() - started:.1f}s")

    if spec.resume_step is None:
        trainer = Trainer(base_model, tokenizer, config, spec.lora, device=spec.device)
        current = spec.start_step
        path = checkpoint_path(spec.checkpoint_root, current)
        if path.exists():  # left by a worker that died before recording it
            shutil.rmtree(path)
        trainer.save_checkpoint(path, step=current, metrics={})
        hooks.record_checkpoint(step=current, path=path, metrics={})
    else:
        current = spec.resume_step
        trainer = Trainer.resume(
            base_model,
            tokenizer,
            checkpoint_path(spec.checkpoint_root, current),
            config,
            spec.lora,
            device=spec.device,
        )
        # The run's own first start continues the model; any later start picks the run up again.
        if current == spec.start_step:
            hooks.event(f"Loaded checkpoint step {current}: training continues from it")
        else:
            hooks.event(f"Resumed from checkpoint step {current}")
    return trainer, tokenizer, dtype, current


def _run_training(spec: RunSpec, hooks: RunHooks) -> str:
    if spec.objective in ("sft", "dpo"):
        from training.supervised import run_supervised

        if spec.config.devices > 1:
            raise ValueError(
                f"devices: {spec.config.devices} applies to GRPO runs only, not {spec.objective}"
            )

        return run_supervised(spec, hooks)
    trainer, tokenizer, dtype, current = start_trainer(spec, hooks)
    with data_parallel_ranks(spec, current, hooks) as followers:
        return _train(spec, hooks, trainer, tokenizer, dtype, current, followers)


@contextlib.contextmanager
def data_parallel_ranks(spec: RunSpec, current: int, hooks: RunHooks) -> Iterator[Any]:
    """With ``devices`` > 1, the update's other ranks (training.distributed.Followers), started
    on the checkpoint at ``current`` and stopped when the run ends however it ends; else None."""
    if spec.config.devices <= 1:
        yield None
        return
    from training.distributed import Followers, FollowerSpec

    if spec.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < spec.config.devices:
            raise ValueError(
                f"devices: {spec.config.devices} needs that many GPUs on the worker's host; it has "
                f"{torch.cuda.device_count()}"
            )
    follower_spec = FollowerSpec(
        base_model_source=spec.base_model_source, model_cache_dir=spec.model_cache_dir, device=spec.device,
        unsloth=spec.unsloth, config=spec.config, lora=spec.lora,
        checkpoint=checkpoint_path(spec.checkpoint_root, current),
    )  # fmt: skip
    followers = Followers(follower_spec, spec.config.devices, rendezvous_dir=spec.checkpoint_root)
    hooks.event(f"Policy update data-parallel on {spec.config.devices} devices ({followers.backend})")
    try:
        yield followers
    finally:
        followers.close()


def _train(spec: RunSpec, hooks: RunHooks, trainer: Any, tokenizer: Any, dtype: Any, current: int,
           followers: Any) -> str:  # fmt: skip
    import torch

    from training.adapter_check import verify_sampler

    config = spec.config
    sampler = PolicySampler(spec, trainer, tokenizer, dtype, current)
    # A fixed probe prompt: after every save, the sampler must score it exactly as the trainer does.
    probes = [spec.environment.start(spec.train_rows[0]["data"], seed=0).messages]
    if spec.environment.tools:  # an MCP server's tools are listed by now: say which the model gets
        hooks.event(f"Environment tools: {', '.join(tool.name for tool in spec.environment.tools)}")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    final_step = spec.start_step + config.steps
    # The untrained policy: the baseline later evaluations are read against. A resumed run evaluates
    # its resume step only if that was due and the dead worker recorded the step, not its evaluation.
    if spec.resume_step is None or (
        is_evaluation_step(
            current, start_step=spec.start_step, final_step=final_step, interval=config.eval_interval
        )
        and not hooks.is_evaluated(step=current)
    ):
        evaluate_during_run(spec, sampler.engine, sampler.adapter, current, hooks)

    watch = SignalWatch(
        patience=config.no_signal_patience,
        grader_name=str(spec.reward_name or spec.grader_spec.get("name") or spec.grader_spec.get("type")),
    )
    for step in range(current + 1, final_step + 1):
        reason = hooks.should_stop()
        if reason:
            return reason
        step_started = time.monotonic()
        label = step_label(step, start_step=spec.start_step, final_step=final_step)
        draw = _Draw(spec, sampler, hooks, step=step, label=label)
        groups, rows, grading = draw.rows(config.groups_per_step, draw=0)
        batch = groups
        if config.dynamic_sampling:
            groups, rows, grading, batch = draw.until_full(groups, rows, grading)
        rollout_seconds = draw.rollout_seconds
        if hooks.should_stop() == "cancelled":
            return "cancelled"
        phase(hooks, "updating", f"{label}: updating the policy", step=step)
        sampler.before_update()
        train_groups = [
            to_train_group(group, overlong_filter=config.overlong_filter, max_new_tokens=config.max_new_tokens,
                           length_penalty_buffer=config.length_penalty_buffer)
            for group in batch
        ]  # fmt: skip
        rate = learning_rate_at(config, step - spec.start_step, config.steps)
        if followers is None:
            metrics = trainer.train_step(train_groups, learning_rate=rate)
        else:  # the other ranks take the same update with this one; a lost rank is restarted
            metrics = followers.update(
                trainer, train_groups, learning_rate=rate, checkpoint=checkpoint_path(spec.checkpoint_root, step - 1),
                on_restart=lambda message: hooks.event(message, level="warn"),
            )  # fmt: skip
        if config.dynamic_sampling:
            metrics.update(draw.summary(groups, batch))
        if config.length_penalty_buffer:  # what to_train_group added to each reward
            penalties = [
                sample.reward - float(t.reward)
                for train, group in zip(train_groups, batch, strict=True)
                for sample, t in zip(train.samples, group, strict=True)
            ]
            metrics["length_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
        sync_started = time.monotonic()  # sync: save, wake the sampler, load and check the adapter
        completion_tokens = sum(sampled_tokens(t) for group in groups for t in group)
        path = checkpoint_path(spec.checkpoint_root, step)
        phase(hooks, "saving", f"{label}: saving checkpoint", step=step)
        if path.exists():
            shutil.rmtree(path)
        trainer.save_checkpoint(path, step=step, metrics=metrics)
        sampler.use_checkpoint(f"step-{step}", path)
        # Fail loudly if training did not reach the sampler (peers shipped exactly that bug).
        check = verify_sampler(
            sampler.engine, trainer, tokenizer, path, probes, adapter=sampler.adapter, tolerance=tolerance
        )
        step_seconds = time.monotonic() - step_started
        metrics.update(grading)
        metrics.update(
            {
                "rollout_seconds": rollout_seconds,
                "sync_seconds": time.monotonic() - sync_started,
                "step_seconds": step_seconds,
                "completion_tokens": float(completion_tokens),
                "tokens_per_second": completion_tokens / max(rollout_seconds, 1e-9),
                "sampler_logprob_gap": check.max_logprob_gap,
                **device_usage(spec.device, step_seconds),
            }
        )
        flat = [
            (group_index, row["index"], trajectory)
            for group_index, (group, row) in enumerate(zip(groups, rows, strict=True))
            for trajectory in group
        ]
        if not hooks.record_step(step=step, metrics=metrics, trajectories=flat, path=path):
            return "lost"
        for warning in watch.observe(step=step, groups=groups, metrics=metrics):
            hooks.event(warning.message, level="warn", data=warning.data)
        if is_evaluation_step(
            step, start_step=spec.start_step, final_step=final_step, interval=config.eval_interval
        ):
            evaluate_during_run(spec, sampler.engine, sampler.adapter, step, hooks)
        logger.info("step %d done in %.1fs: reward %.3f", step, step_seconds, metrics.get("reward_mean", 0.0))
    return "succeeded"
