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

from pathlib import Path
from typing import Any

from training.engines.base import Engine
from training.hosting.followers import Followers, MirroredSession
from training.recipes.grpo_update import grpo_train_step
from training.rollouts.trajectory import TrainGroup
from training.session.adapter_check import SamplerCheck, verify_sampler
from training.session.contract import Session
from training.session.local import TrainingSession
from training.session.policy import Policy


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
