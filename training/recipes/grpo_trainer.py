"""The GRPO trainer: a policy (training.session.policy) with GRPO's update as one call per step.

``Trainer.train_step(groups)`` runs the GRPO recipe (training.recipes.grpo_update.grpo_step) over
the policy's session, on every data-parallel rank when the update is data-parallel
(training.hosting.ranks): a run's followers mirror each primitive of it (``run_session``), the path
every recipe takes. Everything else (the model, adapter, optimizer, RNG and checkpoint format)
is the policy's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from training.engines.base import Engine
from training.hosting.followers import Followers, MirroredSession
from training.hosting.ranks import DataParallelSession, is_data_parallel
from training.recipes.grpo_update import grpo_step
from training.rollouts.trajectory import TrainGroup
from training.session.adapter_check import SamplerCheck, verify_sampler
from training.session.contract import Session
from training.session.local import TrainingSession
from training.session.policy import Policy


class Trainer(Policy):
    """A policy trained one GRPO step at a time."""

    # ---------------------------------------------------------------- one update
    def train_step(
        self, groups: list[TrainGroup], *, learning_rate: float | None = None, session: Session | None = None
    ) -> dict[str, float]:
        """One GRPO step from sampled groups (``num_minibatches`` × ``ppo_epochs`` optimizer
        steps at ``learning_rate``, the config's when None); returns the step's metrics
        (training.recipes.grpo_update.grpo_step). ``session``: the session the update's primitives
        go through, e.g. a run's mirrored to its data-parallel followers (``run_session``), whose
        ranks then take every primitive with this one, as SFT's and DPO's do; this trainer's own
        when None."""
        session_for = self._session if session is None else _devices_of(session)
        metrics = grpo_step(session_for, groups, self.config, step=self.step + 1, learning_rate=learning_rate)
        self.step += 1
        return metrics

    def _session(self, metrics: dict[str, float]) -> Session:
        """The session the update runs over: this trainer's, over every rank when the update is
        data-parallel (training.hosting.ranks)."""
        local = TrainingSession(self)
        if not is_data_parallel():
            return local
        ranks = DataParallelSession(local)  # every rank runs this update on the same samples
        metrics["update_devices"] = float(ranks.world_size)
        return ranks

    # ---------------------------------------------------------------- what a run asks of its trainer
    # (the same four calls as training.hosting.service_run.ServiceTrainer's: the run never asks which)
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


def _devices_of(session: Session) -> Callable[[dict[str, float]], Session]:
    """The update's session is ``session``; its metrics say over how many devices it ran."""

    def session_for(metrics: dict[str, float]) -> Session:
        metrics["update_devices"] = float(getattr(session, "world_size", 1))
        return session

    return session_for
