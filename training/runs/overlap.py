"""A run whose rollouts overlap training (``max_off_policy_steps`` = k > 0).

The synchronous loop takes turns: roll out step N from checkpoint N−1, update, save, roll out
N+1. Here the update of step N runs on a thread of its own while the main thread rolls out step
N+1, N+2 … from an older checkpoint, never more than k updates behind: the rollouts of step s
sample checkpoint v(s) = max(f, s − 1 − k), where f is the run's first checkpoint.
The sampler is detached from the trainer (``PolicySampler(detached=True)``: a copy of the base
model of its own on the CPU, a vLLM that stays awake on a GPU) and loads each checkpoint once, in
order, after the trainer saved it. The importance ratio of the update is taken against the
sampler's own logprobs, as always, so the clipping bounds how far a stale sample pushes.

What stays as in the synchronous loop: steps are recorded in order, each only after its checkpoint
is saved; every checkpoint the sampler loads is checked against the trainer's policy at the moment
it was saved (training.session.adapter_check.probe_policy / check_sampler); the hooks are called from this
thread only; a resumed run is bit-identical to an uninterrupted one. The lag does not restart at
the resume checkpoint c: the first steps after it sample the checkpoints before c they sampled
the first time (fetched with c; their probes are taken by loading each into the trainer for the
probe only, training.session.adapter_check.probe_saved), with the same per-step seeds. Only when one of
those was deleted (a retention policy) does the attempt restart the lag at c, and says so. What
differs: the update thread holds the trainer, the main thread only the sampler.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from training.runs.evaluation import evaluate_during_run, is_evaluation_step
from training.runs.learning_signal import SignalWatch
from training.runs.progress import phase, step_label
from training.runs.sampler import PolicySampler, evaluate_start
from training.runs.spec import RunHooks, RunSpec
from training.runs.steps import DrawnStep, checkpoint_path, draw_step, record_step, update_step
from training.session.adapter_check import PolicyProbe, check_sampler, probe_policy, probe_saved
from training.session.checkpoint_files import ADAPTER_WEIGHTS

Update = tuple[dict[str, Any], Any, PolicyProbe, list[str]]  # metrics, folder, probe, rank restarts


def policy_step_for(step: int, *, lag: int, first: int) -> int:
    """The checkpoint the rollouts of ``step`` sample: ``lag`` updates behind at most, never
    before ``first`` (the run's first checkpoint, whatever attempt this is)."""
    return max(first, step - 1 - lag)


def lag_floor(spec: RunSpec, hooks: RunHooks, current: int) -> int:
    """The first checkpoint this attempt may sample: the run's first, so that a resumed attempt
    samples what the uninterrupted run did; ``current`` when a checkpoint it would need is gone."""
    lag, first = spec.config.max_off_policy_steps, spec.start_step
    needed = range(policy_step_for(current + 1, lag=lag, first=first), current)
    missing = [
        v for v in needed if not (checkpoint_path(spec.checkpoint_root, v) / ADAPTER_WEIGHTS).is_file()
    ]
    if not missing:
        return first
    hooks.event(
        f"Checkpoint{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
        f"{'are' if len(missing) > 1 else 'is'} gone (a retention policy?): the steps after "
        f"{current} sample checkpoint {current} and later, so this resumed run is no longer "
        "identical to an uninterrupted one",
        level="warn",
    )
    return current


@contextlib.contextmanager
def split_threads(device: str) -> Iterator[None]:
    """On the CPU, half the torch threads each for the rollouts and the update, which now run at
    once (each thread's parallel regions use the process setting); restored after."""
    if device != "cpu":
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_overlapped(
    spec: RunSpec,
    hooks: RunHooks,
    trainer: Any,
    tokenizer: Any,
    dtype: Any,
    current: int,
    followers: Any,
    *,
    watch: SignalWatch,
    probes: list[list[dict]],
    tolerance: float,
) -> str:
    """Train ``spec.config.steps`` steps from ``current`` with rollouts overlapping the updates;
    "succeeded", "cancelled" or "lost", as ``training.runs.loop.run_training``."""
    config = spec.config
    lag, final_step = config.max_off_policy_steps, spec.start_step + config.steps
    root = spec.checkpoint_root
    phase(hooks, "loading", "Loading the rollout sampler: rollouts overlap the updates "
          f"(at most {lag} step{'s' if lag > 1 else ''} off-policy)")  # fmt: skip
    first = lag_floor(spec, hooks, current)
    start = policy_step_for(current + 1, lag=lag, first=first)  # < current: a resumed attempt
    sampler = PolicySampler(spec, trainer, tokenizer, dtype, start, detached=True)

    def taken(version: int) -> PolicyProbe:
        """The trainer's probe of checkpoint ``version`` (the one it holds, or an earlier one); on a
        base to be sharded, on every rank (the first one shards it)."""
        path = checkpoint_path(root, version)
        take = partial(probe_policy if version == current else probe_saved, trainer, tokenizer, path, probes)
        if followers is None:
            return take()
        return followers.probe(trainer, probes, checkpoint=checkpoint_path(root, current), take=take,
                               saved=None if version == current else path,
                               on_restart=lambda message: hooks.event(message, level="warn"))  # fmt: skip

    # The trainer's answers for the checkpoints the sampler will load, taken before it trains on.
    probes_taken = {v: taken(v) for v in range(start, current + 1)}
    gaps = {start: _check(sampler, probes_taken.pop(start), probes, tolerance)}

    def due(step: int) -> bool:
        return is_evaluation_step(step, start_step=spec.start_step, final_step=final_step,
                                  interval=config.eval_interval)  # fmt: skip

    def advance(version: int) -> None:
        """Load checkpoint ``version`` into the sampler, check it, evaluate it if due."""
        sampler.use_checkpoint(version, checkpoint_path(root, version))
        gaps[version] = _check(sampler, probes_taken.pop(version), probes, tolerance)
        # A checkpoint up to the resume point was evaluated by the attempt before, unless it died first.
        if due(version) and (version > current or not hooks.is_evaluated(step=version)):
            evaluate_during_run(spec, sampler.engine, sampler.adapter, version, hooks)

    def update(drawn: DrawnStep) -> Update:  # on the update thread: no hooks here
        restarts: list[str] = []
        metrics, path = update_step(spec, trainer, followers, drawn, on_restart=restarts.append)
        probe = partial(probe_policy, trainer, tokenizer, path, probes)
        if followers is not None:  # on a sharded base every rank runs the probe's forward passes
            taken = followers.probe(trainer, probes, checkpoint=path, take=probe, on_restart=restarts.append)
        else:
            taken = probe()
        return metrics, path, taken, restarts

    if start == current:  # else the sampler reaches ``current`` later, and advance() evaluates it
        evaluate_start(spec, hooks, sampler, current)
    pending: deque[tuple[DrawnStep, Future[Update]]] = deque()
    last_recorded = time.monotonic()

    def finish() -> bool:
        """Wait for the oldest pending update and record its step; False if the run was lost."""
        nonlocal last_recorded
        drawn, future = pending.popleft()
        waiting = time.monotonic()
        metrics, path, probe, restarts = future.result()
        for message in restarts:
            hooks.event(message, level="warn")
        probes_taken[drawn.step] = probe
        now = time.monotonic()
        metrics["update_wait_seconds"] = now - waiting  # the rollouts were done before the update
        step_seconds, last_recorded = now - last_recorded, now
        return record_step(spec, hooks, watch, drawn, metrics, path, step_seconds=step_seconds,
                           sampler_logprob_gap=gaps[drawn.policy_step])  # fmt: skip

    threads = contextlib.ExitStack()  # the split lasts while the two sides run at once
    with ThreadPoolExecutor(1, thread_name_prefix="artweb-update") as updates:
        try:
            threads.enter_context(split_threads(spec.device))
            for step in range(current + 1, final_step + 1):
                reason = hooks.should_stop()
                if reason:
                    return reason
                version = policy_step_for(step, lag=lag, first=first)
                while pending and pending[0][0].step <= version:
                    if not finish():
                        return "lost"
                if sampler.step != version:
                    advance(version)
                label = step_label(step, start_step=spec.start_step, final_step=final_step)
                drawn = draw_step(spec, sampler, hooks, step=step, label=label, policy_step=version)
                if hooks.should_stop() == "cancelled":
                    return "cancelled"
                behind = f" (samples {drawn.off_policy_steps} behind)" if drawn.off_policy_steps else ""
                phase(hooks, "updating", f"{label}: updating the policy while the next rollouts run{behind}",
                      step=step)  # fmt: skip
                pending.append((drawn, updates.submit(update, drawn)))
            while pending:
                if not finish():
                    return "lost"
            threads.close()
            # Checkpoints no rollouts sampled: the last one (the run's result) is checked in the
            # sampler like every other, and any due for evaluation is evaluated.
            for version in range((sampler.step if sampler.step is not None else current) + 1, final_step + 1):
                if version == final_step or due(version):
                    advance(version)
                else:
                    probes_taken.pop(version)
            return "succeeded"
        finally:
            threads.close()
            for _, future in pending:  # an update not yet started is not wanted any more
                future.cancel()
            sampler.release()


def _check(sampler: PolicySampler, probe: PolicyProbe, probes: list[list[dict]], tolerance: float) -> float:
    """Fail loudly unless the sampler serves the checkpoint the trainer saved; the logprob gap."""
    return check_sampler(
        sampler.engine, probe, probes, adapter=sampler.adapter, tolerance=tolerance
    ).max_logprob_gap
