"""A platform run whose training session lives in this process: the in-process counterpart of
training.hosting.service_run.ServiceRun.

The run loop (training.runs.loop) asks its run the same calls whichever it has — ``train_step``,
``save_checkpoint``, ``run_session``, ``session_engine``, ``check_sampler``, ``close`` — and never
which it has. Here they are the policy's own (training.session.policy): GRPO's update is the recipe
``training.recipes.grpo_update.grpo_train_step`` over it, on every data-parallel rank when the
update is data-parallel (training.hosting.ranks), and a run's followers mirror each primitive of it
(``run_session``), the path every recipe takes.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from training.engines.base import Engine
from training.hosting.followers import Followers, MirroredSession
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.trajectory import TrainGroup
from training.runs.progress import phase
from training.runs.steps import checkpoint_path
from training.session.adapter_check import SamplerCheck, verify_sampler
from training.session.contract import Session
from training.session.local import TrainingSession
from training.session.policy import Policy, load_policy_model


class InProcessRun(Policy):
    """A run's policy, trained in this process. A Policy itself rather than a holder of one: the
    sampler, the data-parallel followers and the sampler checks of a run in the worker read the
    policy's model, adapter and optimizer directly."""

    def train_step(
        self, groups: list[TrainGroup], *, learning_rate: float | None = None, session: Session | None = None
    ) -> dict[str, float]:
        """One GRPO step (``grpo_train_step``) over this policy, or over ``session`` (``run_session``'s,
        with followers)."""
        return grpo_train_step(self, groups, learning_rate=learning_rate, session=session)

    def run_session(self, followers: Followers | None = None) -> Session:
        """The session a run's recipe calls: this process's, mirrored to the data-parallel
        followers when there are any."""
        local = TrainingSession(self)
        if followers is None:
            return local
        # One per followers: its ranks hold one DataParallelSession each, which rank 0's
        # (MirroredSession builds it once per process group) must meet; a new one every step would
        # wait on a collective the followers never start.
        mirrored = getattr(self, "_mirrored", None)
        if mirrored is None or mirrored.followers is not followers:
            mirrored = self._mirrored = MirroredSession(local, followers)
        return mirrored

    def session_engine(self, tokenizer: Any) -> Engine | None:
        """None: rollouts sample this process's policy (training.runs.sampler builds the engine)."""
        return None

    def check_sampler(
        self, engine: Engine, tokenizer: Any, path: Path, probes: list[list[dict]], *, adapter: str | None,
        tolerance: float,
    ) -> SamplerCheck:  # fmt: skip
        """The checkpoint at ``path`` is what ``engine`` samples (training.session.adapter_check)."""
        return verify_sampler(engine, self, tokenizer, path, probes, adapter=adapter, tolerance=tolerance)

    def close(self) -> None:
        """Nothing to give back: the policy lives in this process."""


def start_in_worker(spec: Any, hooks: Any) -> tuple[InProcessRun, Any, Any, int]:
    """training.runs.loop.start_run with the run's session in this process: the base model loaded
    here, then a fresh adapter saved and recorded as the start step's checkpoint, or the
    checkpoint ``spec.resume_step`` restored. The worker host's ``start_run``
    (training.hosting.resident.ResidentSessions), and where a run the service refuses trains."""
    config = spec.config
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    started = time.monotonic()
    phase(hooks, "loading", f"Loading base model {spec.base_model_source}")
    base_model, tokenizer, dtype = load_policy_model(spec.base_model_source, spec.model_cache_dir,
                                                     device=spec.device, unsloth=spec.unsloth,
                                                     fsdp=config.fsdp)  # fmt: skip
    hooks.event(f"Loaded base model {spec.base_model_source} in {time.monotonic() - started:.1f}s")

    if spec.resume_step is None:
        run = InProcessRun(base_model, tokenizer, config, spec.lora, device=spec.device)
        current = spec.start_step
        path = checkpoint_path(spec.checkpoint_root, current)
        if path.exists():  # left by a worker that died before recording it
            shutil.rmtree(path)
        run.save_checkpoint(path, step=current, metrics={})
        hooks.record_checkpoint(step=current, path=path, metrics={})
    else:
        current = spec.resume_step
        run = InProcessRun.resume(
            base_model, tokenizer, checkpoint_path(spec.checkpoint_root, current), config, spec.lora,
            device=spec.device,
        )  # fmt: skip
        # The run's own first start continues the model; any later start picks the run up again.
        if current == spec.start_step:
            hooks.event(f"Loaded checkpoint step {current}: training continues from it")
        else:
            hooks.event(f"Resumed from checkpoint step {current}")
    return run, tokenizer, dtype, current


class InProcessHost:
    """The host of a run built with no SessionHost (a benchmark's, a test's, a worker's without a
    trainer service): this process. Its one call is the SessionHost's ``start_run``."""

    kind = "worker"

    def start_run(self, spec: Any, hooks: Any) -> tuple[InProcessRun, Any, Any, int]:
        return start_in_worker(spec, hooks)


IN_PROCESS = InProcessHost()
