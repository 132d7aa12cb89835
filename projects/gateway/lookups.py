"""A short-lived, per-process memory of the gateway's per-request lookups, so that a client
sending many requests does not pay three database round trips on each (they were most of the
gateway's added latency).

What is remembered, for GATEWAY_LOOKUP_CACHE_S seconds (default 1; 0 turns it off):
- an API key that authenticated (by the SHA-256 of the presented key): a key revoked meanwhile
  keeps working for up to that long in each web process that saw it. Failed lookups are not
  remembered, so a new key works at once. The key's and its team's settings come with it: a change
  of which completions are stored (projects.gateway.capture) applies up to that long late;
- a (team, model id) route: the checkpoint it resolves to and the live servers for it. So a new
  checkpoint becomes `:latest` up to that long after it is recorded, a new server receives traffic
  up to that long after it registers, and a server that stopped is still tried for up to that long
  (the gateway then moves on to the next one, or answers 503). Routes without a live server are not
  remembered, so recovery is seen at once.

Rate limiting is not cached: every request is counted.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from django.conf import settings

MAX_ENTRIES = 10_000  # a bound on memory; the whole map is dropped when it is reached


def cache_seconds() -> float:
    return float(settings.GATEWAY_LOOKUP_CACHE_S)


class ExpiringMap:
    """A thread-safe map whose entries expire `seconds` after they are put."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def put(self, key: Any, value: Any, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
            self._entries[key] = (time.monotonic() + seconds, value)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


api_keys = ExpiringMap()
routes = ExpiringMap()


def key_digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()
