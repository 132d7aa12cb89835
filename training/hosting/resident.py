"""Sessions kept between a model's client training jobs: in the worker process (a SessionPool: many
models' adapters on one copy of each base) or in the host's trainer service (training.hosting.service).

An ART client trains its model one job at a time, each from the step the last one recorded. Loading
the base model and the adapter, optimizer and RNG state from disk for every job cost 1.2 s of each
call on the bundled model (far more on a large one). A session is kept under the checkpoint it
saved (``SessionKey``: model, step, content digest), as its tag; the next job uses it only if it
starts from exactly that checkpoint, else loads that checkpoint into it from the store. A job that
fails, or whose step is not recorded, closes its session: what is kept always equals a recorded
checkpoint, so resuming from it and from disk train the same.

A job *attaches* its spec to a session (``spec.session`` and the tokenizer), trains, then
*settles*: kept under the step it recorded, or closed.

Both keepers are the worker's one ``SessionHost`` (``kind``: training.hosting.placement's WORKER or
SERVICE), which every kind of work opens its sessions through: client jobs ``attach`` and
``settle``; work that names its session itself (a Tinker client's training session, a sampler's)
``open``s it (replacing any session of that id) and ``use``s it (claimed for the block;
``SessionGone`` when the host no longer has it); a platform run ``start_run``s (its session opened,
or restored from its checkpoint, under ``spec.session_id``). The caller never asks which keeper it
has; the placement rule, which reads ``kind``, says which work may go where.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from training.config import LoraSpec, TrainConfig
from training.hosting.client import TrainerServiceError
from training.hosting.in_process import start_in_worker
from training.hosting.placement import SERVICE, WORKER
from training.hosting.pool import SessionPool
from training.hosting.service_run import HostUnavailable, start_on_service
from training.runs.art_step import ClientStepSpec, context_length
from training.session.contract import Session

if TYPE_CHECKING:
    from training.runs.spec import RunHooks, RunSpec


class SessionGone(LookupError):
    """The host no longer holds the session (its process restarted, or it was closed)."""


class SessionHost(Protocol):
    kind: str  # training.hosting.placement.WORKER or SERVICE: where the sessions live

    def open(
        self,
        session_id: str,
        base_model: str,
        config: TrainConfig,
        lora: LoraSpec,
        *,
        state: Path | None = None,
    ) -> None:
        """A new session under ``session_id`` (from ``state``, else a fresh adapter), replacing any."""

    def use(self, session_id: str) -> AbstractContextManager[Session]:
        """The session for the block, claimed by this process; SessionGone if the host has none."""

    def attach(self, spec: ClientStepSpec, key: SessionKey) -> None:
        """Give a client job's ``spec`` the session of ``key.model`` at exactly ``key``."""

    def settle(self, model: str, kept: SessionKey | None) -> None:
        """A client job is over: keep its session under ``kept``, or close it (None)."""

    def start_run(self, spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
        """A platform run's session (training.runs.loop.start_run): the run's handle, tokenizer,
        dtype and the step it is at."""


@dataclass(frozen=True)
class SessionKey:
    model: str  # a name for the trained model, e.g. "model-12": the session's id
    step: int  # the checkpoint the session holds
    digest: str  # the checkpoint's content digest (or its path when it has none)
    base_model_source: str
    devices: int = 1  # a session opened data-parallel on more devices is another session
    fsdp: bool = False  # so is one whose base is sharded across them

    @property
    def tag(self) -> str:
        devices = f"|devices={self.devices}" if self.devices > 1 else ""
        fsdp = "|fsdp" if self.fsdp else ""
        return f"{self.base_model_source}|{self.step}|{self.digest}{devices}{fsdp}"


class ResidentSessions:
    """This process's kept sessions: ``capacity`` models' adapters on a SessionPool, the least
    recently used closed first (0: none kept; every job loads its checkpoint). A platform run's
    session here is a policy of its own (its base model loaded for it: its device, loader, sharding,
    data-parallel followers and sampler read it directly), not one of the pool's adapters."""

    kind = WORKER

    def __init__(self, load_base: Callable[[str], tuple[Any, Any]], *, capacity: int, spill_dir: Any,
                 **pool_options: Any) -> None:  # fmt: skip
        self.capacity = capacity
        self.pool = SessionPool(
            load_base, spill_dir=spill_dir, **pool_options
        )  # device, model_cache_dir, ...
        self.hits = 0
        self.misses = 0
        self._using: dict[str, Any] = {}
        self._kept: list[str] = []  # the models whose sessions jobs left here

    def attach(self, spec: ClientStepSpec, key: SessionKey) -> None:
        """Give ``spec`` the session of ``key.model`` at exactly ``key`` (loading it if needed)."""
        started = time.monotonic()
        pool, session_id = self.pool, key.model
        if session_id in pool and pool.tag(session_id) == key.tag:
            self.hits += 1
        else:
            self.misses += 1
            pool.close(session_id)  # stale (another checkpoint or devices) or absent
            if (
                spec.config.devices > 1
            ):  # a process trains one data-parallel session: free it from a kept job's
                for other in pool.data_parallel_sessions():
                    if other in self._kept and other not in self._using:
                        pool.close(other)
            pool.open(
                session_id, key.base_model_source, spec.config, spec.lora, state=spec.resume_from, tag=None
            )
        pool.configure(session_id, spec.config)  # the job's own settings (learning rate, temperature, ...)
        using = pool.use(session_id)
        session = using.__enter__()
        self._using[session_id] = using
        trainer = session.trainer
        if spec.resume_from is None:
            trainer.step = spec.from_step
        spec.session, spec.tokenizer = session, trainer.tokenizer
        spec.model_max = context_length(trainer.model.get_base_model())
        spec.load_seconds = time.monotonic() - started

    def settle(self, model: str, kept: SessionKey | None) -> None:
        """The job is over: keep its session under ``kept`` (the checkpoint it recorded), or close
        it (None: failed, or not recorded)."""
        using = self._using.pop(model, None)
        if using is not None:
            using.__exit__(None, None, None)
        if kept is None or self.capacity <= 0:
            self.pool.close(model)
            return
        self.pool.set_tag(model, kept.tag)
        kept_models = {*self._kept, model}
        self._kept = [m for m in self.pool.sessions() if m in kept_models]  # least recently used first
        while len(self._kept) > self.capacity:  # only jobs' sessions: others (Tinker's) are not ours to close
            self.pool.close(self._kept.pop(0))

    def __len__(self) -> int:
        return len(self.pool.sessions())

    def start_run(self, spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
        return start_in_worker(spec, hooks)

    # ------------------------------------------------------------------ SessionHost
    def open(
        self,
        session_id: str,
        base_model: str,
        config: TrainConfig,
        lora: LoraSpec,
        *,
        state: Path | None = None,
    ) -> None:
        self.pool.close(session_id)
        self.pool.open(session_id, base_model, config, lora, state=state)

    @contextmanager
    def use(self, session_id: str) -> Iterator[Session]:
        if session_id not in self.pool:
            raise SessionGone(session_id)
        with self.pool.use(session_id) as session:
            yield session


class ServiceSessions:
    """The host's trainer service keeps the sessions (training.hosting.service): the same
    attach / settle as ``ResidentSessions``, over a claimed and heartbeated lease. The worker loads
    only the tokenizer; checkpoints are written by the service, so they must lie under its folder
    (the host's data folder)."""

    kind = SERVICE

    def __init__(self, client: Any, *, holder: str,
                 load_tokenizer: Callable[[str], tuple[Any, int | None]] | None = None,
                 lease_s: float = 60.0) -> None:  # fmt: skip
        self.client = client  # a training.hosting.client.TrainerServiceClient
        self.holder = holder  # this worker (a job's claim on a session is this worker's)
        self.lease_s = lease_s
        # base model source -> (tokenizer, context length), for client jobs (a host that only
        # starts runs needs none: a run's spec names its tokenizer's cache)
        self._load_tokenizer = load_tokenizer
        self._tokenizers: dict[str, tuple[Any, int | None]] = {}
        self._held: dict[str, tuple[Any, Any]] = {}  # model -> (RemoteSession, its keep_alive)
        self.hits = 0
        self.misses = 0

    def attach(self, spec: ClientStepSpec, key: SessionKey) -> None:
        started = time.monotonic()
        try:
            session = self.client.claim(key.model, holder=self.holder, tag=key.tag, config=spec.config,
                                        lease_s=self.lease_s)  # fmt: skip
            self.hits += 1
        except TrainerServiceError as exc:
            if exc.status not in (404, 412):
                raise
            self.misses += 1
            if exc.status == 412:  # it holds another checkpoint than the job starts from: close it
                self.client.claim(key.model, holder=self.holder, lease_s=self.lease_s).close()
            session = self.client.open(
                key.model, holder=self.holder, base_model=key.base_model_source, config=spec.config, lora=spec.lora,
                state=str(spec.resume_from) if spec.resume_from is not None else None, lease_s=self.lease_s,
                closable=True,  # kept under a recorded checkpoint: opened again from it when gone
            )  # fmt: skip
        alive = session.keep_alive()
        alive.__enter__()
        self._held[key.model] = (session, alive)
        if key.base_model_source not in self._tokenizers:
            if self._load_tokenizer is None:
                raise ValueError(
                    "this trainer-service host was built without a tokenizer loader for client jobs"
                )
            self._tokenizers[key.base_model_source] = self._load_tokenizer(key.base_model_source)
        spec.session = session
        spec.tokenizer, spec.model_max = self._tokenizers[key.base_model_source]
        spec.load_seconds = time.monotonic() - started

    def settle(self, model: str, kept: SessionKey | None) -> None:
        held = self._held.pop(model, None)
        if held is None:
            return
        session, alive = held
        alive.__exit__(None, None, None)
        if kept is None:
            session.close()
        else:
            session.set_tag(kept.tag)
            session.release()

    def start_run(self, spec: RunSpec, hooks: RunHooks) -> tuple[Any, Any, Any, int]:
        """The run's session opened on the service under ``spec.session_id``, held by this worker
        (training.hosting.service_run); HostUnavailable when the service does not answer."""
        try:
            return start_on_service(self.client, self.holder, spec, hooks, lease_s=self.lease_s)
        except OSError as exc:
            raise HostUnavailable(str(exc)) from exc

    # ------------------------------------------------------------------ SessionHost
    def open(
        self,
        session_id: str,
        base_model: str,
        config: TrainConfig,
        lora: LoraSpec,
        *,
        state: Path | None = None,
    ) -> None:
        try:
            self.client.claim(session_id, holder=self.holder).close()
        except TrainerServiceError as exc:
            if exc.status != 404:
                raise
        self.client.open(session_id, holder=self.holder, base_model=base_model, config=config, lora=lora,
                         state=str(state) if state else None).release()  # fmt: skip

    @contextmanager
    def use(self, session_id: str) -> Iterator[Session]:
        try:
            session = self.client.claim(session_id, holder=self.holder)
        except TrainerServiceError as exc:
            if exc.status == 404:
                raise SessionGone(session_id) from None
            raise
        try:
            yield session
        finally:
            session.release()


if TYPE_CHECKING:  # both keepers are a SessionHost: mypy checks these against the protocol

    def _hosts(resident: ResidentSessions, service: ServiceSessions) -> list[SessionHost]:
        return [resident, service]
