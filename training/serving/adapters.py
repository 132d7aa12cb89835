"""The LoRA adapters loaded into one engine, least-recently-used first out.

Invariant: only the generation thread calls `acquire` (it loads, evicts and then generates with
the adapter), so an adapter is never evicted while a batch uses it; other threads only read
`loaded()`, under the lock. Adapters are addressed by checkpoint path, and only paths inside the
configured checkpoint root are accepted: the path arrives over HTTP.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from training.serving import metrics
from training.serving.protocol import RequestError


def check_adapter_path(raw: str, root: Path) -> Path:
    """The resolved checkpoint directory for `raw`, or RequestError (403 outside `root`, 404 when
    there is no adapter there). Symlinks are resolved before the check."""
    path = Path(raw).resolve()
    if not path.is_relative_to(Path(root).resolve()):
        raise RequestError("the adapter path is outside this server's checkpoint directory",
                           code="adapter_path_forbidden", status=403)  # fmt: skip
    if not (path / "adapter_config.json").is_file():
        raise RequestError("the checkpoint's adapter files are missing on this server",
                           code="model_not_found", status=404)  # fmt: skip
    return path


def adapter_name(path: Path) -> str:
    """A stable engine-side name for the adapter at `path` (peft names cannot hold '/' or '.')."""
    return "ckpt_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]


class AdapterCache:
    def __init__(self, engine: Any, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.engine = engine
        self.capacity = capacity
        self._loaded: OrderedDict[Path, str] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()
        self.loads = 0
        self.evictions = 0

    def acquire(self, path: Path) -> str:
        """The engine name of the adapter at `path`, loading it (and evicting the least recently
        used one beyond capacity) on first use."""
        name = self._loaded.get(path)
        if name is not None:
            with self._lock:
                self._loaded.move_to_end(path)
            return name
        while len(self._loaded) >= self.capacity:
            oldest, oldest_name = next(iter(self._loaded.items()))
            self.engine.unload_adapter(oldest_name)
            with self._lock:
                del self._loaded[oldest]
            self.evictions += 1
            metrics.ADAPTER_EVICTIONS.inc()
            metrics.LOADED_ADAPTERS.set(len(self._loaded))
        name = adapter_name(path)
        self.engine.load_adapter(name, path)
        with self._lock:
            self._loaded[path] = name
        self.loads += 1
        metrics.ADAPTER_LOADS.inc()
        metrics.LOADED_ADAPTERS.set(len(self._loaded))
        return name

    def loaded(self) -> list[str]:
        """Loaded checkpoint paths, most recently used last."""
        with self._lock:
            return [str(path) for path in self._loaded]
