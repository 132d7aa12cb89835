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
never unsloth's), the Policy moves only the adapter to the device, and ``fully_shard`` moves each
rank's shard of every layer there (one layer whole at a time). A lost rank takes its shards with it:
rank 0 loads its base again (``reload_base``) and every rank shards it anew once the ranks start again.

Followers (rank 1..N-1 processes started by rank 0) and the mirrored session: training.hosting.followers.

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

import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.engines.base import Choice, SamplingParams
from training.session.contract import Datum, ForwardBackwardResult
from training.session.local import TrainingSession
from training.session.losses import KL_AVERAGE, LossInputError

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
