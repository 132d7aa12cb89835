"""Data-parallel ranks 1..N-1 as processes of their own, started and driven by rank 0.

A Tinker training client with ``devices: N`` (training.hosting.pool): rank 0 is its session in the
trainer process (a ``MirroredSession`` with a ``replay_dir``: it restarts a lost follower itself and
replays the calls since the last optim_step, since a client's gradients accumulate over requests).

A run with ``devices: N`` (training.runs.loop.data_parallel_ranks): rank 0 is the worker's own process,
which rolls out, grades, checkpoints and records; ``Followers`` are ranks 1..N-1, spawned on the
same host, resumed from rank 0's checkpoint, and updated with it. Every recipe's session (GRPO's,
SFT's, DPO's) is a ``MirroredSession``: every primitive rank 0 calls is sent to the followers
first, and each calls it on its own rank, so any objective written over the session primitives
runs data-parallel without the followers knowing it (they hold a policy, no recipe).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from training.hosting.ranks import (
    COLLECTIVE_TIMEOUT_S,
    DataParallelSession,
    backend_for,
    is_data_parallel,
    log,
    shard_base,
)
from training.session.contract import ForwardBackwardResult, check_token_ids
from training.session.local import TrainingSession
from training.session.policy import Policy, load_policy_model

T = TypeVar("T")


@dataclass
class FollowerSpec:
    """What a follower needs to hold the same trainer as rank 0 (plain values: it is pickled)."""

    base_model_source: str
    model_cache_dir: Path
    device: str
    unsloth: str
    config: Any  # training.config.TrainConfig
    lora: Any  # training.config.LoraSpec
    checkpoint: Path  # the checkpoint rank 0 holds now: every follower resumes from it


class Followers:
    """Ranks 1..N-1 of a run's data-parallel update: subprocesses started here that resume the
    trainer from the checkpoint rank 0 (this process) holds, then take each update with it.

    Rank 0 rolls out and grades alone; for each update it sends the step's groups and rate down a
    pipe to every follower (``train_step``) and then runs the update itself (``InProcessRun.train_step``), whose
    session is data-parallel (``is_data_parallel``): the ranks meet in the update's collectives.
    Followers wait on their pipe, not in a collective, so rollouts of any length never time one
    out; a follower whose parent is gone (the worker was killed) exits within a second.
    """

    def __init__(self, spec: FollowerSpec, world_size: int, *, rendezvous_dir: Path,
                 start_timeout_s: float = 600.0) -> None:  # fmt: skip
        if is_data_parallel() or dist.is_initialized():
            raise RuntimeError("a data-parallel update is already running in this process")
        self.spec = spec
        self.backend = backend_for(spec.device)
        self.world_size = world_size
        self.rendezvous_dir = rendezvous_dir
        self.start_timeout_s = start_timeout_s
        self.pipes: list[Any] = []
        self.processes: list[Any] = []
        self.restarts = 0
        self.generation = 0  # process groups started so far: a MirroredSession rebuilds on a new one
        _active.append(self)
        self._start(spec)

    def _start(self, spec: FollowerSpec) -> None:
        world_size, start_timeout_s = self.world_size, self.start_timeout_s
        self.rendezvous_dir.mkdir(parents=True, exist_ok=True)
        rendezvous = self.rendezvous_dir / f".rendezvous-{uuid.uuid4().hex}"
        for rank in range(1, world_size):
            pipe, process = _start_follower()
            self.pipes.append(pipe)
            self.processes.append(process)
            # The run's settings go down the pipe, never into the child's arguments or environment.
            pipe.send(("start", rank, world_size, str(rendezvous), self.backend, spec, os.getpid()))
        try:
            if self.backend == "nccl":
                torch.cuda.set_device(0)
            dist.init_process_group(self.backend, init_method=f"file://{rendezvous}", rank=0,
                                    world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))  # fmt: skip
            for rank, pipe in enumerate(self.pipes, start=1):
                self._expect_ready(rank, pipe, start_timeout_s)
            self.generation += 1
        except BaseException:
            self.close()
            raise
        finally:
            rendezvous.unlink(missing_ok=True)

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def _expect_ready(self, rank: int, pipe: Any, timeout_s: float) -> None:
        if not pipe.poll(timeout_s):
            raise RuntimeError(f"data-parallel rank {rank} did not load the policy within {timeout_s:.0f}s")
        message = pipe.recv()
        if message[0] != "ready":
            raise RuntimeError(f"data-parallel rank {rank} failed to start: {message[1]}")

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` to every follower; RankLost if one is gone."""
        for rank, (pipe, process) in enumerate(zip(self.pipes, self.processes, strict=True), start=1):
            if process.poll() is not None:
                raise RankLost(f"data-parallel rank {rank} exited (status {process.returncode})")
            try:
                pipe.send(message)
            except (BrokenPipeError, OSError) as exc:
                raise RankLost(f"data-parallel rank {rank} cannot be reached: {exc}") from exc

    def probe(self, trainer: Any, probe_messages: list[list[dict[str, Any]]], *, checkpoint: Path,
              take: Callable[[], T], saved: Path | None = None,
              on_restart: Callable[[str], None] | None = None) -> T:  # fmt: skip
        """``take()``: rank 0's probe of the policy it holds, saved at ``checkpoint``
        (training.session.adapter_check.probe_policy), or of an earlier checkpoint ``saved``
        (probe_saved); on a base to be sharded (``fsdp``) every follower runs the same forward
        passes with it, and every rank shards the base first if it is not yet. A follower lost
        before or during the probe: rank 0 loads its base again, the followers start again from
        ``checkpoint``, every rank shards the base anew and the probe is taken again on all of
        them (no rank ever holds the whole base on its device)."""
        if not trainer.config.fsdp:
            return take()
        message = ("probe", probe_messages, None if saved is None else str(saved))
        try:
            self.send(message)
            shard_base(trainer)  # sharded already, unless no update has run since the ranks started
            return take()
        except Exception as exc:
            if not self.lost():
                raise
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        reload_base(trainer, self.spec)
        if on_restart is not None:
            on_restart(f"A data-parallel rank was lost at the check of {Path(saved or checkpoint).name} "
                       f"({reason}); restarting the ranks from {Path(checkpoint).name} and checking it again")  # fmt: skip
        self.restart(Path(checkpoint))
        self.send(message)  # the new followers shard their base first
        shard_base(trainer)
        return take()

    def run(self, trainer: Any, update: Callable[[], dict[str, float]], *, checkpoint: Path,
            on_restart: Callable[[str], None] | None = None) -> dict[str, float]:  # fmt: skip
        """``update()`` (rank 0's side of an update the followers take part in). If a follower
        dies before or during it, rank 0's trainer is put back as it was before the update, the
        followers are started again from ``checkpoint`` (the state rank 0 held before the
        update) and the update is redone once: nothing is lost, the step's result is the one an
        unbroken update gives."""
        before = _snapshot(trainer)
        try:
            return update()
        except Exception as exc:
            if not self.lost():
                raise
            reason = str(exc).splitlines()[0][:200]
        if getattr(trainer, "sharded", False):
            # The base's other shards went with the lost rank: rank 0 loads it again.
            reload_base(trainer, self.spec, state=before)
        else:
            _restore(trainer, before)
        if on_restart is not None:
            on_restart(f"A data-parallel rank was lost during the update ({reason}); restarting the ranks "
                       f"from {Path(checkpoint).name} and redoing the update")  # fmt: skip
        self.restart(Path(checkpoint))
        return update()

    def restart(self, checkpoint: Path) -> None:
        """Stop the followers (a lost one among them) and start them all again from ``checkpoint``."""
        self._stop()
        self.spec = replace(self.spec, checkpoint=checkpoint)
        self.restarts += 1
        self._start(self.spec)

    def lost(self, wait_s: float = 5.0) -> bool:
        """Whether a follower is gone (waiting briefly: a collective may fail before its peer's
        exit is visible)."""
        deadline = time.monotonic() + wait_s
        while True:
            if any(process.poll() is not None for process in self.processes):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    def close(self) -> None:
        """Stop the followers and leave the process group (idempotent)."""
        self._stop()
        if self in _active:
            _active.remove(self)

    def _stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(("stop",))
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        for pipe in self.pipes:
            pipe.close()
        self.pipes, self.processes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()


class MirroredSession:
    """Rank 0's session of an update whose every primitive the followers mirror: each call is sent
    down their pipes first, then run here over every rank (``DataParallelSession``, built anew
    whenever the followers' process group is new: after a restart). The followers answer the
    calls in order on their own ``DataParallelSession`` (training.hosting.follower). Whatever else is asked of
    it (sample, save_state, the trainer, ...) is rank 0's session's: the ranks hold the same state.

    ``replay_dir``: the session recovers from a lost follower by itself, for a caller whose
    gradients accumulate over several calls (a Tinker client): the calls since the last
    ``optim_step`` are logged; when a follower is gone, rank 0's gradients are dropped, its state
    (unchanged since that step: only an optim_step changes it) is saved under ``replay_dir``, the
    followers restart from it, the logged calls are replayed over every rank, and the failed call is
    run again. Without it, a lost follower raises and the caller recovers (``Followers.run``)."""

    def __init__(
        self, session: TrainingSession, followers: Followers, *, replay_dir: Path | None = None
    ) -> None:
        self.session, self.followers = session, followers
        self.replay_dir = replay_dir
        self._parallel: DataParallelSession | None = None
        self._generation = -1
        self._since_step: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.recoveries = 0

    def use(self, session: TrainingSession) -> MirroredSession:
        """Rank 0's primitives through ``session`` from now on (the same trainer, e.g. a pool's
        session object of this use)."""
        self.session = session
        if self._parallel is not None:
            self._parallel.session = session
        return self

    def __getattr__(self, name: str) -> Any:  # only for what the class does not define
        if name.startswith("__") or name == "session":
            raise AttributeError(name)
        return getattr(self.session, name)

    @property
    def world_size(self) -> int:
        return self.followers.world_size

    def forward_backward(self, *args: Any, **kwargs: Any) -> ForwardBackwardResult:
        return self._call("forward_backward", args, kwargs)  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> list[list[float]]:
        return self._call("forward", args, kwargs)  # type: ignore[no-any-return]

    def optim_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return {**self._call("optim_step", args, kwargs), "update_devices": float(self.world_size)}

    def reset_optimizer(self) -> None:
        self._call("reset_optimizer", (), {})

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.replay_dir is None:
            return self._mirror(name, args, kwargs)
        try:
            result = self._mirror(name, args, kwargs)
        except Exception as exc:
            if getattr(exc, "raised_on_every_rank", False) or not (
                isinstance(exc, RankLost) or self.followers.lost()
            ):
                raise
            self._recover(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            result = self._mirror(name, args, kwargs)
        if name == "optim_step" or name == "reset_optimizer":
            self._since_step.clear()
        elif name == "forward_backward" and not kwargs.get("forward_only"):
            self._since_step.append((name, args, kwargs))
        return result

    def _recover(self, reason: str) -> None:
        assert self.replay_dir is not None
        log.warning("a data-parallel rank was lost (%s): restarting the ranks and replaying %d call(s)",
                    reason, len(self._since_step))  # fmt: skip
        trainer = self.session.trainer
        trainer.optimizer.zero_grad(set_to_none=True)  # rank 0's share of the lost calls: replayed below
        folder = self.replay_dir / "ranks-state"
        trainer.save_checkpoint(folder, step=trainer.step, metrics={})
        if trainer.sharded:  # the lost rank took its shards: rank 0 loads its base again
            reload_base(trainer, self.followers.spec)
        self.followers.restart(folder)
        self.recoveries += 1
        for name, args, kwargs in self._since_step:
            self._mirror(name, args, kwargs)

    def _mirror(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in ("forward", "forward_backward"):  # a bad token id: refused before any rank runs
            check_token_ids(args[0] if args else kwargs["data"], self.session.vocabulary)
        self.followers.send(("call", name, args, kwargs))
        if self._parallel is None or self._generation != self.followers.generation:
            self._parallel = DataParallelSession(self.session)  # meets the followers' broadcast
            self._generation = self.followers.generation
        return getattr(self._parallel, name)(*args, **kwargs)


_active: list[Followers] = []  # this process's running followers (at most one data-parallel run)


def follower_pids() -> list[int]:
    """Process ids of this process's followers (operators' tools and tests)."""
    return [pid for followers in _active for pid in followers.pids()]


class RankLost(RuntimeError):
    """A follower of a data-parallel update exited or cannot be reached."""


def reload_base(trainer: Any, spec: FollowerSpec, *, state: dict[str, Any] | None = None) -> None:
    """Rank 0's trainer on a freshly loaded base (its sharded one cannot be gathered once a rank is
    lost; a base to be sharded again is loaded into CPU memory, see the module doc), holding the
    adapter, optimizer state and step it held before (or ``state``, a ``_snapshot`` taken
    earlier); the process's random states are left as they were. The trainer object stays the
    caller's."""
    if state is None:
        state = _snapshot(trainer)
    states = (torch.get_rng_state(), random.getstate())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    base_model, _, _ = load_policy_model(spec.base_model_source, spec.model_cache_dir, device=str(trainer.device),
                                         unsloth=spec.unsloth, fsdp=trainer.config.fsdp)  # fmt: skip
    fresh = Policy(base_model, trainer.tokenizer, trainer.config, trainer.lora, trainer.device,
                    adapter_name=trainer.adapter_name)  # fmt: skip
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    trainer.__dict__.update(fresh.__dict__)
    _restore(trainer, state)


def _snapshot(trainer: Any) -> dict[str, Any]:
    """What an update changes on rank 0: the adapter weights, the optimizer state, the step."""
    return {
        "params": [p.detach().clone() for p in trainer.trainable_parameters],
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "step": trainer.step,
    }


def _restore(trainer: Any, snapshot: dict[str, Any]) -> None:
    with torch.no_grad():
        for parameter, saved in zip(trainer.trainable_parameters, snapshot["params"], strict=True):
            parameter.copy_(saved)
    trainer.optimizer.load_state_dict(snapshot["optimizer"])
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step = snapshot["step"]


def _start_follower() -> tuple[Any, subprocess.Popen[bytes]]:
    """A follower process (``python -m training.hosting.follower``) and a two-way pipe to it. A plain
    subprocess, not multiprocessing's: a Celery pool process is daemonic and may not have
    multiprocessing children. Its arguments are the pipe's two descriptors, nothing else."""
    from multiprocessing.connection import Connection

    down_read, down_write = os.pipe()  # rank 0 -> follower
    up_read, up_write = os.pipe()  # follower -> rank 0
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "training.hosting.follower", str(down_read), str(up_write)],
            pass_fds=(down_read, up_write),
            cwd=Path(__file__).resolve().parents[2],  # the repository root
        )
    finally:
        os.close(down_read)
        os.close(up_write)
    return Duplex(Connection(up_read, writable=False), Connection(down_write, readable=False)), process


class Duplex:
    """One end of the two pipes as one connection (send, recv, poll, close)."""

    def __init__(self, incoming: Any, outgoing: Any) -> None:
        self.incoming, self.outgoing = incoming, outgoing

    def send(self, message: Any) -> None:
        self.outgoing.send(message)

    def recv(self) -> Any:
        return self.incoming.recv()

    def poll(self, timeout: float) -> bool:
        return bool(self.incoming.poll(timeout))

    def close(self) -> None:
        self.incoming.close()
        self.outgoing.close()
