"""Stored checkpoints fetched onto this inference server's disk, under a byte budget.

Invariants:
- only folders under ``root`` (the server's own fetch cache, a folder no trainer writes into) are
  ever counted or evicted; a fetch that returns a folder elsewhere (the local store's own folders)
  is used as it is and never deleted;
- an evicted folder is first renamed to a hidden sibling, then removed: a reader sees the whole
  folder or none, and the next request for it fetches it again (``get`` checks the folder is
  still there before answering from the index);
- the folder just fetched, and any used within ``grace_s``, are not evicted: a request between
  ``get`` and the engine's load of the adapter never finds its folder gone. The budget may be
  exceeded for that long, never silently (``over_budget`` in ``stats``).

A hit is a request answered without a download: from the index, or from a copy on disk the store
verified (same folder before and after the fetch call). The hit rate is hits / (hits + misses).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from training.serving import metrics

log = logging.getLogger(__name__)

Fetch = Callable[[str, str], Path]  # (key, sha256) -> a verified local folder; may download


@dataclass
class _Entry:
    path: Path
    sha256: str  # "" for a folder found on disk at start-up (verified by the store on first use)
    size_bytes: int
    used_at: float  # time.monotonic() of the last request that used it


def folder_bytes(path: Path) -> int:
    return sum((Path(dirpath) / name).stat().st_size for dirpath, _, names in os.walk(path) for name in names)


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder, or None: a fetch that downloaded renames a new folder in."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return (stat.st_dev, stat.st_ino)


class FetchedCheckpoints:
    """The verified local copies of stored checkpoints this server serves (see the module doc).

    ``budget_bytes`` 0 means no budget. ``get`` is called from helper threads (it may download),
    so the index is under a lock; the download itself runs outside it.
    """

    def __init__(
        self, fetch: Fetch, *, root: Path | None, budget_bytes: int = 0, grace_s: float = 60.0
    ) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be 0 (no budget) or more")
        self.fetch = fetch
        self.root = Path(root).resolve() if root is not None else None
        self.budget_bytes = budget_bytes
        self.grace_s = grace_s
        self.hits = self.misses = self.evictions = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # key -> entry, least recently used first
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}  # one per key ever asked for: a few bytes each
        self._scan()
        metrics.FETCH_CACHE_BUDGET.set(budget_bytes)
        self._evict(keep="")

    # ------------------------------------------------------------------ reads
    def get(self, key: str, sha256: str) -> Path:
        """The folder holding stored checkpoint ``key`` with digest ``sha256``; the fetch's own
        errors (FileNotFoundError, a digest mismatch, an unreachable store) pass through."""
        found = self._lookup(key, sha256)
        if found is not None:
            return found
        with self._lock:
            fetching = self._fetching.setdefault(key, threading.Lock())
        with fetching:  # one download per key: concurrent requests for it wait for the first
            found = self._lookup(key, sha256)
            return found if found is not None else self._fetch(key, sha256)

    def cached(self, key: str, sha256: str) -> Path | None:
        """The folder of ``key`` if it is here already (a hit, counted), else None; never
        downloads, so an event loop may call it and go to a thread only for a miss."""
        return self._lookup(key, sha256)

    def _lookup(self, key: str, sha256: str) -> Path | None:
        with self._lock:
            entry = self._entries.get(key)
            usable = entry is not None and entry.sha256 == sha256
            if entry is not None and usable and (entry.path / "adapter_config.json").is_file():
                entry.used_at = time.monotonic()
                self._entries.move_to_end(key)
                self._count_hit()
                return entry.path
        return None

    def _fetch(self, key: str, sha256: str) -> Path:
        before = _identity(self.root / key) if self.root is not None else None
        path = Path(self.fetch(key, sha256)).resolve()
        # Only our own folders are counted and evicted; another folder (the local store's) is the
        # store itself: kept in the index for the hit count and key_of, never removed.
        owned = self.root is not None and path.is_relative_to(self.root)
        with self._lock:
            self._entries[key] = _Entry(path, sha256, folder_bytes(path) if owned else 0, time.monotonic())
            self._entries.move_to_end(key)
            if owned and (before is None or _identity(path) != before):
                self.misses += 1
                metrics.FETCH_CACHE_MISSES.inc()
            else:
                self._count_hit()
            self._evict(keep=key)
        return path

    def used_bytes(self) -> int:
        with self._lock:
            return self._used()

    def key_of(self, path: Path) -> str | None:
        """The store key of a fetched folder, or None (a folder this cache does not hold)."""
        resolved = Path(path).resolve()
        with self._lock:
            return next((key for key, entry in self._entries.items() if entry.path == resolved), None)

    def stats(self) -> dict[str, object]:
        with self._lock:
            used, asked = self._used(), self.hits + self.misses
            return {
                "budget_bytes": self.budget_bytes,
                "used_bytes": used,
                "over_budget": bool(self.budget_bytes and used > self.budget_bytes),
                "checkpoints": len(self._entries),
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": round(self.hits / asked, 4) if asked else None,
                "evictions": self.evictions,
            }

    # ------------------------------------------------------------------ internals (under the lock)
    def _count_hit(self) -> None:
        self.hits += 1
        metrics.FETCH_CACHE_HITS.inc()

    def _owns(self, path: Path) -> bool:
        return self.root is not None and path.is_relative_to(self.root)

    def _used(self) -> int:
        return sum(entry.size_bytes for entry in self._entries.values())

    def _evict(self, *, keep: str) -> None:
        """Remove least recently used folders until the budget holds, sparing ``keep`` and those
        used within the grace period."""
        if self.budget_bytes:
            now = time.monotonic()
            for key in list(self._entries):
                if self._used() <= self.budget_bytes:
                    break
                entry = self._entries[key]
                if key == keep or now - entry.used_at < self.grace_s or not self._owns(entry.path):
                    continue
                del self._entries[key]
                _remove(entry.path)
                self.evictions += 1
                metrics.FETCH_CACHE_EVICTIONS.inc()
                log.info("evicted %s (%d bytes) from the checkpoint cache", key, entry.size_bytes)
        metrics.FETCH_CACHE_BYTES.set(self._used())

    def _scan(self) -> None:
        """Count what an earlier run of this server left in ``root`` (oldest first), so the budget
        holds across restarts. Hidden folders (downloads in progress, evictions) are skipped."""
        found: list[tuple[float, str, Path]] = []
        if self.root is not None and self.root.is_dir():
            for dirpath, dirnames, filenames in os.walk(self.root):
                dirnames[:] = sorted(name for name in dirnames if not name.startswith("."))
                if "adapter_config.json" in filenames:
                    folder = Path(dirpath)
                    found.append((folder.stat().st_mtime, folder.relative_to(self.root).as_posix(), folder))
                    dirnames[:] = []
        for _, key, folder in sorted(found):
            # Found at start-up: never used by this process, so evictable at once (used_at far back).
            self._entries[key] = _Entry(folder, "", folder_bytes(folder), used_at=-self.grace_s - 1)


def _remove(path: Path) -> None:
    doomed = path.parent / f".{path.name}.evict-{uuid.uuid4().hex}"
    try:
        path.rename(doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)
