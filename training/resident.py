"""Training sessions kept in a worker process between client training jobs.

An ART client trains its model one job at a time, each from the step the last one recorded. Loading
the base model and the adapter, optimizer and RNG state from disk for every job cost 1.2 s of each
call on the bundled model (far more on a large one). A session this process trained is kept after
its job is recorded, under the checkpoint it saved (model, step, content digest); the next job
takes it only if it starts from exactly that checkpoint, else loads from the store as before. A job
that fails, or whose step is not recorded, never puts its session back: what is kept always equals
a recorded checkpoint, so resuming from it and from disk train the same.

Not yet the resident trainer *service* of ARCHITECTURE.md (sessions shared by every worker of a
host, many adapters on one copy of a base model): one process, ``capacity`` sessions, least
recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SessionKey:
    model: str  # a name for the trained model, e.g. "model-12"
    step: int  # the checkpoint the session holds
    digest: str  # the checkpoint's content digest (or its path when it has none)
    base_model_source: str


class ResidentSessions:
    def __init__(self, capacity: int = 1) -> None:
        self.capacity = capacity
        self._sessions: OrderedDict[SessionKey, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def take(self, key: SessionKey) -> Any | None:
        """The trainer kept under ``key`` (removed: a job owns it while it trains), or None."""
        trainer = self._sessions.pop(key, None)
        # Another checkpoint of the same model: what is kept is stale, never to be used again.
        for stale in [k for k in self._sessions if k.model == key.model]:
            del self._sessions[stale]
        if trainer is None:
            self.misses += 1
        else:
            self.hits += 1
        return trainer

    def keep(self, key: SessionKey, trainer: Any) -> None:
        if self.capacity <= 0:
            return
        for stale in [k for k in self._sessions if k.model == key.model]:
            del self._sessions[stale]
        self._sessions[key] = trainer
        while len(self._sessions) > self.capacity:
            self._sessions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sessions)
