"""The training loop of one run, top to bottom: roll out, grade, update, checkpoint, record.

No Django here: the caller passes a ``RunHooks`` object that records results and answers "should
I stop?". Invariants the loop keeps:
- checkpoint files are complete (atomic rename) before ``hooks.record_step`` is called;
- a step is a pure function of (seed, step, checkpoint before it), so a resumed run redoes an
  unrecorded step exactly as the dead worker would have, and never records one twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from training.hosting.followers import Followers, FollowerSpec
from training.hosting.in_process import IN_PROCESS
from training.hosting.service_run import HostUnavailable, SessionLost, service_refusal
from training.recipes.supervised import run_supervised
from training.runs.evaluation import evaluate_during_run, is_evaluation_step
from training.runs.learning_signal import SignalWatch
from training.runs.overlap import train_overlapped
from training.runs.progress import phase, step_label
from training.runs.sampler import PolicySampler, evaluate_start
from training.runs.spec import RunHooks, RunSpec, StepTrajectories
from training.runs.steps import checkpoint_path, draw_step, record_step, update_step

logger = logging.getLogger(__name__)


def run_training(spec: RunSpec, hooks: RunHooks) -> str:
    """Train ``spec.config.steps`` steps from ``spec.start_step``; returns "succeeded", "cancelled"
    or "lost" (another worker owns the run now). The environment is closed at the end (an MCP
    session and its server process live as long as the run)."""
    try:
        return _run_training(spec, hooks)
    finally:
        spec.environment.close()


def start_run(spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
    """The run's session holder (``InProcessRun`` or ``ServiceRun``: the loop never asks which), its
    tokenizer and dtype, and the step it is at: a fresh adapter saved and recorded as the start
    step's checkpoint, or the checkpoint ``spec.resume_step`` restored. Opened through the run's
    SessionHost (``spec.host``, the one this worker's client work uses too) when the placement
    rule lets the run train there (``service_refusal``), else in this process."""
    host = spec.host if spec.host is not None and service_refusal(spec) is None else IN_PROCESS
    try:
        return host.start_run(spec, hooks)
    except HostUnavailable as exc:  # no answer: a run is not held up by a service that is down
        hooks.event(
            f"The trainer service did not answer ({exc}): this run trains in the worker", level="warn"
        )
    return IN_PROCESS.start_run(spec, hooks)


class _Recorded:
    """The run's hooks, noting the last step whose checkpoint was recorded (where a run whose
    session the trainer service lost continues)."""

    def __init__(self, hooks: RunHooks) -> None:
        self._hooks = hooks
        self.step: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hooks, name)

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        self._hooks.record_checkpoint(step=step, path=path, metrics=metrics)
        self.step = step

    def record_step(
        self, *, step: int, metrics: dict[str, Any], trajectories: StepTrajectories, path: Path
    ) -> bool:
        recorded = self._hooks.record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)
        if recorded:
            self.step = step
        return recorded


SESSION_REBUILDS = 3  # times one attempt of a run continues after the trainer service lost its session


def _run_training(spec: RunSpec, hooks: RunHooks) -> str:
    recorded: Any = _Recorded(hooks)
    for rebuild in range(SESSION_REBUILDS + 1):
        run, tokenizer, dtype, current = start_run(spec, recorded)
        try:
            with data_parallel_ranks(spec, current, recorded) as followers:
                if spec.objective in ("sft", "dpo"):
                    return run_supervised(spec, recorded, run, tokenizer, dtype, current, followers)
                return _train(spec, recorded, run, tokenizer, dtype, current, followers)
        except SessionLost as exc:
            if rebuild == SESSION_REBUILDS:
                raise
            reason = hooks.should_stop()
            if reason:  # the run is no longer this worker's (or was cancelled): nothing to rebuild
                return reason
            resume = recorded.step if recorded.step is not None else current
            hooks.event(
                f"{exc}: the run continues from checkpoint step {resume} on a new session", level="warn"
            )
            spec = dataclasses.replace(spec, resume_step=resume)
        finally:
            run.close()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def data_parallel_ranks(spec: RunSpec, current: int, hooks: RunHooks) -> Iterator[Any]:
    """With ``devices`` > 1, the update's other ranks (training.hosting.followers.Followers), started
    on the checkpoint at ``current`` and stopped when the run ends however it ends; else None."""
    if spec.config.devices <= 1:
        yield None
        return
    if spec.device.startswith("cuda") and torch.cuda.device_count() < spec.config.devices:
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
    sharded = ", the base's weights sharded across them (FSDP2)" if spec.config.fsdp else ""
    hooks.event(
        f"Policy update data-parallel on {spec.config.devices} devices ({followers.backend}){sharded}"
    )
    try:
        yield followers
    finally:
        followers.close()


def _train(spec: RunSpec, hooks: RunHooks, run: Any, tokenizer: Any, dtype: Any, current: int,
           followers: Any) -> str:  # fmt: skip

    config = spec.config
    # A fixed probe prompt: after every save, the sampler must score it exactly as the trainer does.
    probes = [spec.environment.start(spec.train_rows[0]["data"], seed=0).messages]
    if spec.environment.tools:  # an MCP server's tools are listed by now: say which the model gets
        hooks.event(f"Environment tools: {', '.join(tool.name for tool in spec.environment.tools)}")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    watch = SignalWatch(
        patience=config.no_signal_patience,
        grader_name=str(spec.reward_name or spec.grader_spec.get("name") or spec.grader_spec.get("type")),
    )
    if config.max_off_policy_steps:
        return train_overlapped(
            spec, hooks, run, tokenizer, dtype, current, followers, watch=watch, probes=probes, tolerance=tolerance
        )  # fmt: skip
    sampler = PolicySampler(spec, run, tokenizer, dtype, current)
    try:
        final_step = spec.start_step + config.steps
        evaluate_start(spec, hooks, sampler, current)
        for step in range(current + 1, final_step + 1):
            reason = hooks.should_stop()
            if reason:
                return reason
            step_started = time.monotonic()
            label = step_label(step, start_step=spec.start_step, final_step=final_step)
            drawn = draw_step(spec, sampler, hooks, step=step, label=label, policy_step=step - 1)
            if hooks.should_stop() == "cancelled":
                return "cancelled"
            phase(hooks, "updating", f"{label}: updating the policy", step=step)
            sampler.before_update()
            metrics, path = update_step(
                spec, run, followers, drawn, on_restart=lambda message: hooks.event(message, level="warn"),
                on_saving=lambda: phase(hooks, "saving", f"{label}: saving checkpoint", step=step),  # noqa: B023
            )  # fmt: skip
            loading = time.monotonic()  # sync: wake the sampler, load and check the adapter
            sampler.use_checkpoint(step, path)
            # Fail loudly if training did not reach the sampler (peers shipped exactly that bug).
            check = run.check_sampler(sampler.engine, tokenizer, path, probes, adapter=sampler.adapter,
                                      tolerance=tolerance)  # fmt: skip
            metrics["sync_seconds"] += time.monotonic() - loading
            step_seconds = time.monotonic() - step_started
            if not record_step(spec, hooks, watch, drawn, metrics, path, step_seconds=step_seconds,
                               sampler_logprob_gap=check.max_logprob_gap):  # fmt: skip
                return "lost"
            if is_evaluation_step(
                step, start_step=spec.start_step, final_step=final_step, interval=config.eval_interval
            ):
                evaluate_during_run(spec, sampler.engine, sampler.adapter, step, hooks)
            logger.info(
                "step %d done in %.1fs: reward %.3f", step, step_seconds, metrics.get("reward_mean", 0.0)
            )
        return "succeeded"
    finally:
        sampler.release()  # the run's own vLLM stops with it
