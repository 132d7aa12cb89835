"""Where training work keeps its session: the one placement rule.

There are two hosts: the trainer service of the worker's machine (training.hosting.service, many
sessions on one copy of each base model), when the machine runs one, and the worker process itself
(training.hosting.in_process for a run, training.hosting.pool for client work). Data-parallel ranks
are not a third place: whichever host holds a session with ``devices`` > 1 starts and feeds its
ranks (training.hosting.followers).

- **Client work** (ART training jobs, Tinker training and sampling clients) opens its sessions on
  the service whenever there is one; the service's pool starts the ranks of a data-parallel one.
- **A platform run** goes there too unless the run needs the worker: rollouts that overlap the
  update (the rollout thread samples the policy in the worker), a data-parallel update (the run's
  followers are the worker's children) or a vLLM sampler (the worker launches and feeds it).

Callers never ask which host they got: both keep the session contract (training.session.contract).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from training.config import TrainConfig

SERVICE, WORKER = "service", "worker"
Work = Literal["run", "client"]


@dataclass(frozen=True)
class Placement:
    host: str  # SERVICE or WORKER
    reason: str  # why, in a sentence a run's events can show


def place(
    work: Work, *, service: bool, config: TrainConfig | None = None, sampler: str = "transformers"
) -> Placement:
    """Where ``work`` keeps its session. ``service``: the worker's machine runs a trainer service;
    ``config`` and ``sampler`` (the engine kind that samples a run's rollouts): a run's, which decide
    whether it may leave the worker."""
    if not service:
        return Placement(WORKER, "no trainer service on this host")
    if work == "client":
        return Placement(SERVICE, "client work keeps its sessions on the host's trainer service")
    if config is None:
        raise ValueError("a run's placement needs its config")
    if config.devices > 1:
        return Placement(WORKER, "a data-parallel update (devices > 1) runs in the worker")
    if config.max_off_policy_steps:
        return Placement(WORKER, "rollouts that overlap the update sample in the worker")
    if sampler != "transformers":
        return Placement(WORKER, "the vLLM sampler runs in the worker")
    return Placement(SERVICE, "the run trains on the host's trainer service")
