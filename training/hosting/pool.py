"""Many training sessions on one copy of each base model: multi-tenant LoRA.

A pool loads a base model once per source and gives each session its own LoRA adapter on it (peft's
named adapters), its own AdamW optimizer and its own RNG states. Only the session in use has its
adapter active: an inactive adapter is neither computed in the forward pass nor given gradients, so
a session's forward, gradients and updates are exactly those it would get on a base of its own, in
whatever order the sessions of several teams interleave (tests/training/test_session_pool.py).

The pool keeps sessions under a memory budget: when the resident sessions' adapters, gradients and
optimizer moments exceed it, the least recently used idle one is saved with ``save_state`` (adapter,
optimizer, RNG) into the spill folder and its adapter deleted; using it again loads it back, and it
continues bit for bit. A session with gradients accumulated and not yet stepped is never evicted.

A session with ``devices`` > 1 (training.hosting.ranks) is trained data-parallel: its adapter here is
rank 0, and follower processes started from its state hold ranks 1..N-1; every forward,
forward_backward, optim_step and reset_optimizer runs over all ranks (``MirroredSession``, which
restarts a lost follower and replays the calls since the last optim_step), the rest (sampling,
saves) on rank 0 alone. A process joins one process group, so a pool trains at most one such
session at a time; it is never evicted (its ranks hold its state too).

One thread at a time: the caller serialises use (the trainer service holds one lock per pool, a
sample's decoding taking it a slice at a time: ``hold`` keeps such a session resident in between).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from training.config import LoraSpec, TrainConfig
from training.session.local import TrainingSession
from training.session.policy import Policy, initial_rate


class SessionPoolError(KeyError):
    """A session the pool does not hold (never opened, or closed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no such session"


@dataclass
class _Base:
    model: Any  # the base model; a PeftModel once a session has an adapter on it
    tokenizer: Any
    engine: Any = None  # one sampler over the shared model: it samples the live adapter


@dataclass
class _Entry:
    session_id: str
    source: str
    config: TrainConfig
    lora: LoraSpec
    adapter: str  # the peft adapter name (ids may hold characters a module name cannot)
    trainer: Any = None  # None while evicted
    rng: tuple[torch.Tensor, Any] | None = None  # (torch, python) states while not the live session
    tag: Any = None  # what the owner says the session holds (e.g. the checkpoint it equals)
    used_at: float = field(default_factory=time.monotonic)
    spilled: Path | None = None
    ranks: Any = None  # a training.hosting.followers.MirroredSession when the session has devices > 1
    holds: int = 0  # samples decoding on it a slice at a time (``hold``): never evicted meanwhile

    @property
    def base_key(self) -> str:
        """The pool's base this session's adapter is on: its source's, shared with the other
        sessions of that source; a session whose base is sharded across its devices (``fsdp``)
        has one of its own (nothing else may run on a sharded base outside its ranks' lockstep)."""
        return f"{self.source} (fsdp: {self.session_id})" if self.config.fsdp else self.source

    @property
    def resident(self) -> bool:
        return self.trainer is not None

    def bytes(self) -> int:
        """Adapter, gradients and AdamW's two moments: four copies of the trainable parameters."""
        if self.trainer is None:
            return 0
        return 4 * sum(p.numel() * p.element_size() for p in self.trainer.trainable_parameters)

    def pending(self) -> bool:
        """Gradients accumulated and not yet stepped: they live only in memory."""
        return self.trainer is not None and any(p.grad is not None for p in self.trainer.trainable_parameters)


class SessionPool:
    def __init__(
        self,
        load_base: Callable[[str], tuple[Any, Any]],
        *,
        spill_dir: Path,
        budget_bytes: int | None = None,
        device: str = "cpu",
        model_cache_dir: Path | None = None,
        unsloth: str = "off",
    ) -> None:
        self._load_base = load_base  # source -> (model, tokenizer), freshly loaded
        # Where a data-parallel session's follower processes load the base from (None: not offered).
        self.model_cache_dir = model_cache_dir
        self.unsloth = unsloth
        self.spill_dir = Path(spill_dir)
        self.budget_bytes = budget_bytes
        self.device = device
        self._bases: dict[str, _Base] = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._live: _Entry | None = None  # whose RNG states the process's generators hold
        self._names = 0
        self.evictions = 0
        self.reloads = 0
        self.base_loads = 0

    # ------------------------------------------------------------------ lifecycle
    def open(
        self,
        session_id: str,
        source: str,
        config: TrainConfig,
        lora: LoraSpec,
        *,
        state: Path | None = None,
        tag: Any = None,
    ) -> None:
        """A new session: a fresh adapter (seeded by ``config.seed``, as a Policy of its own is) or
        one that continues ``state`` (a ``save_state`` / checkpoint folder)."""
        if session_id in self._entries:
            raise ValueError(f"session {session_id!r} is open already")
        self._names += 1
        entry = _Entry(session_id, source, config, lora, adapter=f"s{self._names}", tag=tag)
        base = self._base(source, entry.base_key)
        self._stash_live()
        if state is None:
            entry.trainer = Policy(
                base.model, base.tokenizer, config, lora, self.device, adapter_name=entry.adapter
            )
        else:
            entry.trainer = Policy.resume(
                base.model, base.tokenizer, state, config, lora, self.device, adapter_name=entry.adapter
            )
        base.model = entry.trainer.model
        self._live = entry
        self._entries[session_id] = entry
        if config.devices > 1:
            try:
                self._start_ranks(entry)
            except BaseException:
                self.close(session_id)
                raise
        self._enforce_budget(keep=entry)

    @contextmanager
    def use(self, session_id: str) -> Iterator[TrainingSession]:
        """The session, live: its adapter active and its RNG states in the process's generators
        (reloaded first when it was evicted). Eviction waits until it is handed back."""
        entry = self._entry(session_id)
        self._activate(entry)
        base = self._bases[entry.base_key]
        base.model = entry.trainer.model  # a sharded session's rank 0 may have loaded its base anew
        if base.engine is None or base.engine.model is not entry.trainer.model:
            from training.engines.transformers_engine import TransformersEngine

            base.engine = TransformersEngine(entry.trainer.model, base.tokenizer, device=entry.trainer.device)
        session = TrainingSession(entry.trainer, base.engine)
        try:
            yield entry.ranks.use(session) if entry.ranks is not None else session
        finally:
            entry.used_at = time.monotonic()
            self._entries.move_to_end(session_id)
            self._enforce_budget(keep=entry)

    def hold(self, session_id: str, held: bool) -> None:
        """Keep the session resident (``held``) while a sample decodes on it between uses (the
        trainer service runs one a slice at a time), or let it go again."""
        entry = self._entry(session_id)
        entry.holds = max(0, entry.holds + (1 if held else -1))

    def close(self, session_id: str) -> None:
        """Forget the session: its adapter and optimizer are freed, its spilled state deleted."""
        entry = self._entries.pop(session_id, None)
        if entry is None:
            return
        if entry.ranks is not None:
            entry.ranks.followers.close()
            shutil.rmtree(self._ranks_dir(entry), ignore_errors=True)
            entry.ranks = None
        if entry.trainer is not None:
            self._drop_adapter(entry)
        if entry.config.fsdp:
            self._bases.pop(entry.base_key, None)  # its own base: nobody else's adapter is on it
        if entry.spilled is not None:
            shutil.rmtree(entry.spilled, ignore_errors=True)
        if self._live is entry:
            self._live = None

    def evict(self, session_id: str) -> None:
        """Save the session's state to the spill folder and free its adapter (see the module doc)."""
        entry = self._entry(session_id)
        if entry.trainer is None:
            return
        if entry.pending():
            raise ValueError(f"session {session_id!r} has gradients not yet stepped: optim_step first")
        if entry.ranks is not None:
            raise ValueError(f"session {session_id!r} is data-parallel: its ranks hold it, it is not evicted")
        if entry.holds:
            raise ValueError(f"session {session_id!r} is sampling: it is not evicted until the sample ends")
        self._activate(entry)  # save_state writes the process's RNG states: make them the session's
        path = self.spill_dir / entry.adapter
        entry.trainer.save_checkpoint(path, step=entry.trainer.step, metrics={})
        entry.spilled = path
        self._stash_live()
        self._drop_adapter(entry)
        self.evictions += 1

    def configure(self, session_id: str, config: TrainConfig) -> None:
        """Another job's settings for the session from now on (learning rate, weight decay,
        temperature, micro-batch budget, ...); its adapter, optimizer moments and RNG stay."""
        entry = self._entry(session_id)
        if config.devices != entry.config.devices:
            raise ValueError(f"session {session_id!r} trains on {entry.config.devices} device(s); "
                             f"its devices cannot change to {config.devices} while it is open")  # fmt: skip
        if config.fsdp != entry.config.fsdp:
            raise ValueError(f"session {session_id!r} has fsdp {str(entry.config.fsdp).lower()}; it cannot "
                             "change while the session is open")  # fmt: skip
        if entry.ranks is not None:
            from training.hosting.followers import RankLost

            followers = entry.ranks.followers
            followers.spec = replace(followers.spec, config=config)  # what a restarted rank starts with
            with contextlib.suppress(RankLost):  # a lost rank: the next primitive restarts it
                followers.send(("configure", config))
        entry.config = config
        if entry.trainer is not None:  # the config as the job stored it, resolved at its creation
            entry.trainer.config = config
            for group in entry.trainer.optimizer.param_groups:
                group["lr"] = initial_rate(config)
                group["weight_decay"] = config.weight_decay

    # ------------------------------------------------------------------ reading
    def tag(self, session_id: str) -> Any:
        return self._entry(session_id).tag

    def set_tag(self, session_id: str, tag: Any) -> None:
        self._entry(session_id).tag = tag

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def sessions(self) -> list[str]:
        return list(self._entries)

    def data_parallel_sessions(self) -> list[str]:
        """The open sessions whose ranks hold followers (at most one: see the module doc)."""
        return [e.session_id for e in self._entries.values() if e.ranks is not None]

    def resident_bytes(self) -> int:
        return sum(entry.bytes() for entry in self._entries.values())

    def stats(self) -> dict[str, Any]:
        return {
            "sessions": len(self._entries),
            "resident": sum(1 for e in self._entries.values() if e.resident),
            "resident_bytes": self.resident_bytes(),
            "budget_bytes": self.budget_bytes,
            "base_models": sorted(self._bases),
            "base_loads": self.base_loads,
            "evictions": self.evictions,
            "reloads": self.reloads,
            "data_parallel": {
                e.session_id: {"devices": e.config.devices, "rank_restarts": e.ranks.followers.restarts}
                for e in self._entries.values()
                if e.ranks is not None
            },
        }

    # ------------------------------------------------------------------ internals
    def _entry(self, session_id: str) -> _Entry:
        entry = self._entries.get(session_id)
        if entry is None:
            raise SessionPoolError(f"no session {session_id!r}")
        return entry

    def _base(self, source: str, key: str | None = None) -> _Base:
        key = source if key is None else key
        base = self._bases.get(key)
        if base is None:
            if key != source and self.model_cache_dir is not None:
                # A base to be sharded (fsdp): loaded as its followers load theirs, never whole on the device.
                from training.session.policy import load_policy_model

                model, tokenizer, _ = load_policy_model(source, self.model_cache_dir, device=self.device,
                                                        unsloth=self.unsloth, fsdp=True)  # fmt: skip
            else:
                model, tokenizer = self._load_base(source)
            base = self._bases[key] = _Base(model, tokenizer)
            self.base_loads += 1
        return base

    def _stash_live(self) -> None:
        """Keep the live session's RNG states with it before another session's take the generators."""
        if self._live is not None and self._live.trainer is not None:
            self._live.rng = (torch.get_rng_state(), random.getstate())
        self._live = None

    def _activate(self, entry: _Entry) -> None:
        if entry.trainer is None:
            self._reload(entry)
        if self._live is not entry:
            self._stash_live()
            assert entry.rng is not None
            torch.set_rng_state(entry.rng[0])
            random.setstate(entry.rng[1])
            entry.rng = None
            self._live = entry
        model = entry.trainer.model
        if model.active_adapter != entry.adapter:
            model.set_adapter(entry.adapter)

    def _reload(self, entry: _Entry) -> None:
        assert entry.spilled is not None
        base = self._base(entry.source, entry.base_key)
        self._stash_live()
        entry.trainer = Policy.resume(base.model, base.tokenizer, entry.spilled, entry.config, entry.lora,
                                      self.device, adapter_name=entry.adapter)  # fmt: skip
        base.model = entry.trainer.model
        shutil.rmtree(entry.spilled, ignore_errors=True)
        entry.spilled = None
        self._live = entry  # resume restored the session's RNG states into the generators
        self.reloads += 1
        self._enforce_budget(keep=entry)

    def _ranks_dir(self, entry: _Entry) -> Path:
        return self.spill_dir / f"{entry.adapter}-ranks"

    def _start_ranks(self, entry: _Entry) -> None:
        """Followers for ranks 1..devices-1 of ``entry`` (live, just opened), started from its state."""
        import torch.distributed as dist

        from training.hosting.followers import Followers, FollowerSpec, MirroredSession

        devices = entry.config.devices
        if self.model_cache_dir is None:
            raise ValueError(f"devices: {devices}: this trainer cannot start data-parallel ranks")
        other = next((e.session_id for e in self._entries.values() if e.ranks is not None), None)
        if other is not None or dist.is_initialized():
            raise ValueError(
                f"devices: {devices}: this trainer process already trains a data-parallel session"
                f"{f' ({other})' if other else ''}, and a process holds one at a time: close it, or ask for 1 device"
            )  # fmt: skip
        if self.device.startswith("cuda") and torch.cuda.device_count() < devices:
            raise ValueError(f"devices: {devices} needs that many GPUs on the trainer's host; it has "
                             f"{torch.cuda.device_count()}")  # fmt: skip
        folder = self._ranks_dir(entry)
        start = folder / "start"
        entry.trainer.save_checkpoint(start, step=entry.trainer.step, metrics={})
        spec = FollowerSpec(base_model_source=entry.source, model_cache_dir=self.model_cache_dir, device=self.device,
                            unsloth=self.unsloth, config=entry.config, lora=entry.lora, checkpoint=start)  # fmt: skip
        followers = Followers(spec, devices, rendezvous_dir=folder)
        entry.ranks = MirroredSession(TrainingSession(entry.trainer), followers, replay_dir=folder)

    def _drop_adapter(self, entry: _Entry) -> None:
        model = entry.trainer.model
        with warnings.catch_warnings():  # "... was active which is now deleted": the pool activates per use
            warnings.filterwarnings("ignore", message=".*which is now deleted", category=UserWarning)
            model.delete_adapter(entry.adapter)
        entry.trainer.optimizer = None
        entry.trainer = None

    def _enforce_budget(self, *, keep: _Entry) -> None:
        if self.budget_bytes is None:
            return
        for entry in list(self._entries.values()):  # least recently used first
            if self.resident_bytes() <= self.budget_bytes:
                return
            if (
                entry is keep
                or not entry.resident
                or entry.pending()
                or entry.ranks is not None
                or entry.holds
            ):
                continue
            self.evict(entry.session_id)
