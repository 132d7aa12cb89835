"""Data-parallel training sessions over torch.distributed (gloo on CPU, NCCL on CUDA).

Every rank holds the same policy and optimizer state. Each primitive is called on every rank with
the whole data; a rank computes only its share (balanced by tokens), and before each optimizer step
the accumulated gradients are summed across the ranks in one all-reduce over one flat buffer, so
every rank steps with the whole data's gradient and the ranks stay identical. Losses are sums over
tokens (training.session), so the summed gradient is one process's gradient on the whole data, up
to the order of floating-point additions (tests/training/test_distributed.py states the tolerance).

Why not torch's DistributedDataParallel wrapper: it all-reduces inside every backward, while a
call here runs one backward per packed row and gradients accumulate across calls (a Tinker client
calls forward_backward several times per optim_step). One all-reduce per optimizer step is what
DDP gives with ``no_sync`` on all but the last backward; here it is the same collective, explicit.

A base too big for one device is sharded (``shard_base``: torch's FSDP2 ``fully_shard`` on each
decoder layer and on the whole model, over every rank): each rank keeps 1/N of the frozen base's
weights and gathers a layer's full weights from the others as its forward (and backward) reaches
it, then frees them. The adapter's parameters are left out of the sharding (``ignored_params``):
they are small, every rank holds all of them, and their gradients are summed as above, so the update
is the same as the unsharded one and rank 0 saves the adapter as before. Every forward pass is then a
collective, so the session runs its calls in lockstep (training.session: as many passes on every
rank as the rank with the most). Nothing may run the sharded model on one rank alone: sampling from
it is refused (``TrainingSession.sample``); a sampler needs its own copy of the base. No rank holds
the whole base on its device: a base to be sharded is loaded into CPU memory (transformers' loader,
never unsloth's), the Trainer moves only the adapter to the device, and ``fully_shard`` moves each
rank's shard of every layer there (one layer whole at a time). A lost rank takes its shards with it:
rank 0 loads its base again (``reload_base``) and every rank shards it anew once the ranks start again.

A Tinker training client with ``devices: N`` (training.hosting.pool): rank 0 is its session in the
trainer process (a ``MirroredSession`` with a ``replay_dir``: it restarts a lost follower itself and
replays the calls since the last optim_step, since a client's gradients accumulate over requests).

A run with ``devices: N`` (training.runs.loop.data_parallel_ranks): rank 0 is the worker's own process,
which rolls out, grades, checkpoints and records; ``Followers`` are ranks 1..N-1, spawned on the
same host, resumed from rank 0's checkpoint, and updated with it. A GRPO run sends each step's
groups (Trainer._update makes its session data-parallel whenever a process group of several is
up); an SFT or DPO run's session is a ``MirroredSession``: every primitive rank 0 calls is sent to
the followers first, and each calls it on its own rank, so any objective written over the session
primitives runs data-parallel without the followers knowing it.

Invariants:
- every rank calls the same primitives in the same order with the same arguments, as collectives
  require; a rank whose share is empty still takes part (its gradient is zero);
- on construction rank 0's adapter weights are broadcast to every rank (a fresh init drawn with
  another seed, a resumed checkpoint: the same policy everywhere from the first step);
- only rank 0 writes a checkpoint (the state is the same on every rank); the others wait for it;
- a primitive that fails in any rank's share (bad input) fails on every rank alike, after the
  collective that tells them, and leaves no gradient of its own behind: the ranks stay in step.
- ``art`` (ART's loss) compares each token's KL with the mean over the whole call: with a KL
  penalty, that mean is summed over every rank's share first (one more all-reduce), so the split
  loss is the whole call's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from training.engines.base import Choice, SamplingParams
from training.session.contract import Datum, ForwardBackwardResult, check_token_ids
from training.session.local import TrainingSession
from training.session.losses import KL_AVERAGE, LossInputError
from training.session.policy import Policy, load_policy_model

T = TypeVar("T")

log = logging.getLogger(__name__)

# How long a rank waits in a collective for the others (an update, not the rollouts between them:
# followers wait for work on a pipe, not in a collective).
COLLECTIVE_TIMEOUT_S = 900.0

# Metrics of a forward_backward that are sums over the call (the rest are per-token averages).
SUMMED_METRICS = frozenset({"loss:sum", "positions", "padding"})


def is_data_parallel() -> bool:
    """Whether this process is one rank of several (a data-parallel update is running)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:<rank>`` on a CUDA host, else ``device`` (CPU: every rank)."""
    return f"cuda:{rank}" if str(device).startswith("cuda") else device


def backend_for(device: str) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def shares(data: Sequence[Datum], world_size: int) -> list[list[int]]:
    """The indices of ``data`` each rank computes: longest first, each to the rank with the fewest
    tokens so far (ties: the lowest rank). Deterministic, so every rank computes the same split."""
    loads = [0] * world_size
    split: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(data)), key=lambda i: (-len(data[i].model_input), i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        split[rank].append(index)
        loads[rank] += len(data[index].model_input)
    return [sorted(indices) for indices in split]


def trained_tokens(datum: Datum) -> int:
    """Targets the loss is on: nonzero weights, or every target when the datum has no weights."""
    weights = datum.loss_fn_inputs.get("weights")
    if weights is None:
        return len(datum.loss_fn_inputs["target_tokens"])
    return sum(1 for weight in weights if weight != 0)


def shard_base(trainer: Any) -> None:
    """Shard ``trainer``'s frozen base model across the ranks of the default process group (FSDP2,
    see the module doc); its LoRA parameters (every adapter's) stay whole on every rank. Called on
    every rank, once; the trainer is ``sharded`` from then on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if trainer.sharded:
        return
    model = trainer.model
    adapters = {parameter for name, parameter in model.named_parameters() if "lora_" in name}
    device_type = torch.device(trainer.device).type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    base = model.get_base_model()
    # The units whose weights are gathered together: transformers names its decoder layer classes
    # (the ones never split across devices); the rest (embeddings, final norm, head) is the root's.
    layer_kinds = set(getattr(base, "_no_split_modules", None) or ())
    for module in base.modules():
        if type(module).__name__ in layer_kinds:
            fully_shard(module, mesh=mesh, ignored_params=adapters)
    # The root too is resharded after each forward (FSDP2 keeps a root gathered by default): a rank's
    # gathers then depend only on its passes, not on what else it did (a state_dict on rank 0, which
    # reshards, before a probe that a follower takes without one would leave the ranks out of step).
    fully_shard(base, mesh=mesh, ignored_params=adapters, reshard_after_forward=True)
    trainer.sharded = True


def local_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds at rest (a sharded parameter's local shard only)."""
    total = 0
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


class DataParallelSession:
    """A TrainingSession's primitives over every rank of the default process group (see the module
    doc). Wraps one rank's session; ``dist.init_process_group`` has been called. ``shard``: shard
    the base across the ranks first (``shard_base``; its trainer's ``config.fsdp`` when None)."""

    def __init__(self, session: TrainingSession, *, shard: bool | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DataParallelSession needs torch.distributed.init_process_group first")
        self.session = session
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for parameter in self.parameters:
                dist.broadcast(parameter.data, src=0)
        if session.trainer.config.fsdp if shard is None else shard:
            shard_base(session.trainer)

    @property
    def parameters(self) -> list[torch.Tensor]:
        return list(self.session.trainer.trainable_parameters)

    # ------------------------------------------------------------------ primitives
    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None,
        *, forward_only: bool = False,
    ) -> ForwardBackwardResult:  # fmt: skip
        """TrainingSession.forward_backward over every rank: this rank's share computed and its
        gradients accumulated here; the loss, metrics and logprobs of the whole data returned on
        every rank."""
        mine = shares(data, self.world_size)[self.rank]
        if loss_fn == "art" and float((loss_fn_config or {}).get("kl_penalty_coef") or 0) > 0:
            loss_fn_config = {
                **(loss_fn_config or {}),
                KL_AVERAGE: self._art_kl_average(data, mine, loss_fn_config),
            }
        empty = ForwardBackwardResult(loss=0.0, metrics={}, logprobs=[])
        result, failure = empty, None
        # A call that fails on any rank leaves no gradient of its own on any rank (put back below).
        before = (
            None if forward_only else [None if p.grad is None else p.grad.clone() for p in self.parameters]
        )
        try:
            if mine:
                result = self.session.forward_backward(
                    [data[i] for i in mine], loss_fn, loss_fn_config, forward_only=forward_only
                )
        except Exception as exc:  # noqa: BLE001 (told to every rank below, raised on each)
            result, failure = empty, exc
        tokens = sum(trained_tokens(data[i]) for i in mine)
        gathered: list[Any] = [None] * self.world_size
        told = _told(failure)
        dist.all_gather_object(gathered, (mine, tokens, result.loss, result.metrics, result.logprobs, told))
        if before is not None and any(part[-1] is not None for part in gathered):
            for parameter, grad in zip(self.parameters, before, strict=True):
                parameter.grad = grad
        _raise_first([part[-1] for part in gathered], self.rank, failure)
        logprobs: list[list[float]] = [[] for _ in data]
        loss, all_tokens = 0.0, 0
        sums: dict[str, float] = {}
        for indices, count, part_loss, metrics, part_logprobs, _ in gathered:
            loss += part_loss
            all_tokens += count
            for index, values in zip(indices, part_logprobs, strict=True):
                logprobs[index] = values
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + (value if name in SUMMED_METRICS else value * count)
        combined = {
            name: value if name in SUMMED_METRICS else value / max(all_tokens, 1)
            for name, value in sums.items()
        }
        return ForwardBackwardResult(loss=loss, metrics=combined, logprobs=logprobs)

    def _art_kl_average(self, data: Sequence[Datum], mine: list[int], config: dict[str, Any] | None) -> float:
        """ART's KL penalty compares each token's KL with the mean over the whole call: that mean,
        from every rank's share (the learner's logprobs computed where the penalty's source is the
        learner, or where the sampler left a logprob out). A share the session cannot read counts
        nothing here: its own call fails next, on every rank."""
        learner_source = (config or {}).get("kl_penalty_source", "sample") != "sample"
        kl, tokens = 0.0, 0
        try:
            trained = {
                i: [t for t, w in enumerate(data[i].loss_fn_inputs.get("weights") or []) if w != 0]
                for i in mine
            }
            sources = {i: list(data[i].loss_fn_inputs.get("logprobs") or []) for i in mine}
            needs = [i for i in mine if learner_source or not all(
                t < len(sources[i]) and math.isfinite(sources[i][t]) for t in trained[i])]  # fmt: skip
            learner = dict(
                zip(
                    needs,
                    self.session.forward([data[i] for i in needs])
                    if needs or self.session.trainer.sharded
                    else [],
                    strict=True,
                )
            )
            for i in mine:
                ref = data[i].loss_fn_inputs.get("ref_logprobs")
                if ref is None:
                    continue
                for t in trained[i]:
                    own = sources[i][t] if t < len(sources[i]) else math.nan
                    source = learner[i][t] if learner_source or not math.isfinite(own) else own
                    kl += source - ref[t]
                    tokens += 1
        except Exception:  # noqa: BLE001 (the share's own forward_backward raises it on every rank)
            kl, tokens = 0.0, 0
        total = torch.tensor([kl, float(tokens)], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total[0] / total[1]) if total[1] > 0 else 0.0

    def forward(self, data: Sequence[Datum], *, reference: Path | str | None = None) -> list[list[float]]:
        """TrainingSession.forward over every rank (no gradients)."""
        mine = shares(data, self.world_size)[self.rank]
        part: list[list[float]] = []
        failure = None
        try:
            if mine:
                part = self.session.forward([data[i] for i in mine], reference=reference)
        except Exception as exc:  # noqa: BLE001 (told to every rank below, raised on each)
            failure = exc
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (mine, part, _told(failure)))
        _raise_first([told for _, _, told in gathered], self.rank, failure)
        logprobs: list[list[float]] = [[] for _ in data]
        for indices, values, _ in gathered:
            for index, row in zip(indices, values, strict=True):
                logprobs[index] = row
        return logprobs

    def optim_step(self, **options: Any) -> dict[str, float]:
        """Sum the gradients of every rank (``reduce_gradients``), then TrainingSession.optim_step
        with ``options``: the same step on every rank."""
        self.reduce_gradients()
        return self.session.optim_step(**options)

    def sample(self, prompts: Sequence[list[int]], sampling: SamplingParams) -> list[Choice]:
        """This rank's policy samples alone (every rank holds the same adapter; no collective). A
        sharded base cannot sample: TrainingSession.sample says so."""
        return self.session.sample(prompts, sampling)

    def reset_optimizer(self) -> None:
        """TrainingSession.reset_optimizer on this rank (every rank calls it: the states stay equal)."""
        self.session.reset_optimizer()

    def reduce_gradients(self) -> None:
        """Replace each rank's accumulated gradients by their sum over the ranks (one all-reduce of
        one flat buffer): afterwards every rank holds the whole data's gradient."""
        parameters = self.parameters
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for parameter in parameters:
            count = parameter.numel()
            parameter.grad = flat[offset : offset + count].view_as(parameter).clone()
            offset += count

    def save_state(self, path: Path, *, step: int, metrics: dict[str, Any]) -> None:
        """Rank 0 writes the checkpoint; every rank is at ``step`` once it is complete."""
        if self.rank == 0:
            self.session.save_state(path, step=step, metrics=metrics)
        else:
            self.session.trainer.step = step
        dist.barrier()

    def save_weights_for_sampler(self, path: Path) -> None:
        if self.rank == 0:
            self.session.save_weights_for_sampler(path)
        dist.barrier()


def _told(failure: Exception | None) -> tuple[str, str] | None:
    """What the other ranks are told of this rank's failure: its kind and message (plain text)."""
    return None if failure is None else (type(failure).__name__, str(failure))


def _raise_first(told: Sequence[tuple[str, str] | None], rank: int, failure: Exception | None) -> None:
    """Raise the lowest failing rank's error of a primitive, on every rank alike (bad input in one
    rank's share fails the call everywhere; no rank is left waiting in the next collective): this
    rank's own exception if it is that rank, else one of the same kind (LossInputError, ValueError,
    TypeError; a RuntimeError naming any other), marked ``raised_on_every_rank``: a follower answers
    it and waits for the next call."""
    for index, error in enumerate(told):
        if error is None:
            continue
        kind, message = error
        raised = (
            failure
            if index == rank and failure is not None
            else _KINDS.get(kind, RuntimeError)(
                message if kind in _KINDS else f"{kind} on data-parallel rank {index}: {message}"
            )
        )
        raised.raised_on_every_rank = True  # type: ignore[attr-defined]
        raise raised


_KINDS: dict[str, type[Exception]] = {
    "LossInputError": LossInputError,
    "ValueError": ValueError,
    "TypeError": TypeError,
}


def run_ranks(
    target: Callable[..., None], world_size: int, *args: Any, rendezvous: Path, backend: str = "gloo"
) -> None:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one
    process group (a file rendezvous at ``rendezvous``, which must not exist yet); returns when all
    have finished, raises if any failed. torch.multiprocessing's spawn: each rank imports anew."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _rank_main, args=(target, world_size, str(rendezvous), backend, args), nprocs=world_size,
        start_method="spawn", join=True,
    )  # fmt: skip


def _rank_main(rank: int, target: Callable[..., None], world_size: int, rendezvous: str, backend: str,
               args: tuple[Any, ...]) -> None:  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        target(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


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
    pipe to every follower (``train_step``) and then runs ``Trainer.train_step`` itself, whose
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

    def train_step(self, groups: list[Any], *, learning_rate: float) -> None:
        """Send the update to every follower (rank 0 runs it next, with them)."""
        self.send(("train", groups, learning_rate))

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

    def update(self, trainer: Any, groups: list[Any], *, learning_rate: float, checkpoint: Path,
               on_restart: Callable[[str], None] | None = None) -> dict[str, float]:  # fmt: skip
        """``trainer.train_step(groups)`` on every rank (see ``run``)."""

        def step() -> dict[str, float]:
            self.train_step(groups, learning_rate=learning_rate)
            return dict(trainer.train_step(groups, learning_rate=learning_rate))

        return self.run(trainer, step, checkpoint=checkpoint, on_restart=on_restart)

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
