"""One GRPO step of a run in its parts, shared by the synchronous loop (training.runs.loop) and the
one whose rollouts overlap training (training.runs.overlap): draw (roll out and grade, with dynamic
sampling's further draws), update (train and save the checkpoint: no hooks, so it may run on
another thread), and the step's metrics and record.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.cost import device_usage, sampled_tokens
from training.recipes.grpo import is_zero_variance
from training.recipes.grpo_update import group_update_advantages
from training.recipes.schedules import learning_rate_at
from training.rewards import grade_trajectories
from training.rollouts.agent import rollout_groups
from training.rollouts.trajectory import (
    TrainGroup,
    Trajectory,
    longest_turn,
    overlong_penalty,
    to_train_group,
)
from training.runs.progress import phase, progress_events

if TYPE_CHECKING:
    from training.config import TrainConfig
    from training.runs.learning_signal import SignalWatch
    from training.runs.spec import RunHooks, RunSpec


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


class Draw:
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
                                     judge=spec.judge, sandbox=spec.sandbox, outbound=spec.outbound,
                                     context={"step": step, "draw": draw})  # fmt: skip
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


@dataclass
class DrawnStep:
    """One step's rollouts and grades, and the checkpoint they were sampled from."""

    step: int
    label: str
    draw: Draw
    groups: list[list[Trajectory]]  # every group drawn
    rows: list[dict[str, Any]]  # their task rows
    grading: dict[str, float]
    batch: list[list[Trajectory]]  # the groups trained on
    policy_step: int  # the checkpoint the sampler held

    @property
    def off_policy_steps(self) -> int:
        """How many updates the samples' policy is behind the one this step updates (0: none)."""
        return self.step - 1 - self.policy_step


def draw_step(
    spec: RunSpec, sampler: Any, hooks: RunHooks, *, step: int, label: str, policy_step: int
) -> DrawnStep:
    """Roll out and grade step ``step``'s rows with ``sampler`` (which holds checkpoint
    ``policy_step``); each trajectory's metrics record that checkpoint and how far behind it is."""
    config = spec.config
    draw = Draw(spec, sampler, hooks, step=step, label=label)
    groups, rows, grading = draw.rows(config.groups_per_step, draw=0)
    batch = groups
    if config.dynamic_sampling:
        groups, rows, grading, batch = draw.until_full(groups, rows, grading)
    drawn = DrawnStep(step, label, draw, groups, rows, grading, batch, policy_step)
    for group in groups:
        for trajectory in group:
            trajectory.metrics["policy_step"] = policy_step
            trajectory.metrics["off_policy_steps"] = drawn.off_policy_steps
    return drawn


def update_step(
    spec: RunSpec,
    trainer: Any,
    followers: Any,
    drawn: DrawnStep,
    *,
    on_restart: Callable[[str], None],
    on_saving: Callable[[], None] = lambda: None,
) -> tuple[dict[str, Any], Path]:
    """The policy update of a drawn step and its checkpoint, saved; its metrics and folder.
    Calls no hooks (``on_restart`` hears of a data-parallel rank restarted)."""
    config = spec.config
    batch = drawn.batch
    train_groups = [
        to_train_group(group, overlong_filter=config.overlong_filter, max_new_tokens=config.max_new_tokens,
                       length_penalty_buffer=config.length_penalty_buffer)
        for group in batch
    ]  # fmt: skip
    rate = learning_rate_at(config, drawn.step - spec.start_step, config.steps)
    if followers is None:
        metrics = trainer.train_step(train_groups, learning_rate=rate)
    else:  # the other ranks mirror every primitive of the update; a lost rank is restarted, the update redone
        session = trainer.run_session(followers)
        metrics = followers.run(
            trainer, lambda: trainer.train_step(train_groups, learning_rate=rate, session=session),
            checkpoint=checkpoint_path(spec.checkpoint_root, drawn.step - 1), on_restart=on_restart,
        )  # fmt: skip
    if config.dynamic_sampling:
        metrics.update(drawn.draw.summary(drawn.groups, batch))
    record_update_signal(drawn, train_groups, config)
    if config.length_penalty_buffer:  # what to_train_group added to each reward
        penalties = [
            sample.reward - float(t.reward)
            for train, group in zip(train_groups, batch, strict=True)
            for sample, t in zip(train.samples, group, strict=True)
        ]
        metrics["length_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    saving = time.monotonic()
    on_saving()
    path = checkpoint_path(spec.checkpoint_root, drawn.step)
    if path.exists():  # left by a worker that died before recording it
        shutil.rmtree(path)
    trainer.save_checkpoint(path, step=drawn.step, metrics=metrics)
    metrics["sync_seconds"] = time.monotonic() - saving
    return metrics, path


def record_update_signal(drawn: DrawnStep, train_groups: list[TrainGroup], config: TrainConfig) -> None:
    """Note in each drawn trajectory's metrics what the update made of it, for the viewer and the
    API to show rather than recompute: ``length_penalty`` (added to the grader's reward),
    ``advantage`` (0.0 where the update left it out) and ``trained``. Groups drawn but not in the
    batch (dynamic sampling replaced them) were not trained on."""
    for group in drawn.groups:
        for trajectory in group:
            penalty = overlong_penalty(
                longest_turn(trajectory), config.max_new_tokens, config.length_penalty_buffer
            )
            trajectory.metrics.update({"length_penalty": penalty, "advantage": 0.0, "trained": False})
    for group, train in zip(drawn.batch, train_groups, strict=True):
        for trajectory, advantage in zip(group, group_update_advantages(train, config), strict=True):
            trajectory.metrics.update(
                {"advantage": 0.0 if advantage is None else advantage, "trained": advantage is not None}
            )


def record_step(
    spec: RunSpec,
    hooks: RunHooks,
    watch: SignalWatch,
    drawn: DrawnStep,
    metrics: dict[str, Any],
    path: Path,
    *,
    step_seconds: float,
    sampler_logprob_gap: float,
) -> bool:
    """Complete a trained step's metrics and record it; False if this worker lost the run."""
    completion_tokens = sum(sampled_tokens(t) for group in drawn.groups for t in group)
    rollout_seconds = drawn.draw.rollout_seconds
    metrics.update(drawn.grading)
    metrics.update(
        {
            "rollout_seconds": rollout_seconds,
            "step_seconds": step_seconds,
            "completion_tokens": float(completion_tokens),
            "tokens_per_second": completion_tokens / max(rollout_seconds, 1e-9),
            "sampler_logprob_gap": sampler_logprob_gap,
            "off_policy_steps": float(drawn.off_policy_steps),
            **device_usage(spec.device, step_seconds),
        }
    )
    metrics.update(tool_endpoint_metrics([t for group in drawn.groups for t in group]))
    flat = [
        (group_index, row["index"], trajectory)
        for group_index, (group, row) in enumerate(zip(drawn.groups, drawn.rows, strict=True))
        for trajectory in group
    ]
    if not hooks.record_step(step=drawn.step, metrics=metrics, trajectories=flat, path=path):
        return False
    for warning in watch.observe(step=drawn.step, groups=drawn.groups, metrics=metrics):
        hooks.event(warning.message, level="warn", data=warning.data)
    return True


def tool_endpoint_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """What tool endpoints (the http_tools environment) added to a step: the calls sent, their mean
    latency, and the longest any rollout waited for them (a step's rollouts run in lockstep, so about
    the time they added to its rollout phase); {} when no rollout called one."""
    timed = [t.metrics for t in trajectories if "tool_endpoint_calls" in t.metrics]
    if not timed:
        return {}
    calls = sum(m["tool_endpoint_calls"] for m in timed)
    return {
        "tool_endpoint_calls": float(calls),
        "tool_latency_mean_s": sum(m["tool_latency_s"] for m in timed) / max(calls, 1),
        "tool_wait_s": max(m["tool_wait_s"] for m in timed),
    }
