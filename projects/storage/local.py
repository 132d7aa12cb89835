"""The embedded default: objects are folders under one root directory (``CHECKPOINT_DIR``).

The root is also the "cache": ``fetch_dir`` returns ``root/key`` itself once its digest checks, so
a checkpoint the trainer wrote at ``CHECKPOINT_DIR/model-3/step-000002`` is stored by ``put_dir``
without a copy. There is no second copy to fetch again from: a folder that fails its check is
refused (ChecksumMismatch), never repaired.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from projects.storage.base import (
    CheckpointStore,
    ChecksumMismatch,
    ObjectNotFound,
    StoredObject,
    check_key,
    folder_digest,
    replace_dir,
    scratch_dir,
)


class LocalCheckpointStore(CheckpointStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.cache_dir = self.root

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_dir(self, key: str, local_dir: Path) -> StoredObject:
        target = self._path(key)
        source = Path(local_dir)
        if source.resolve() == target.resolve():
            stored = folder_digest(target)
        else:
            scratch = scratch_dir(target, "put")
            try:
                shutil.copytree(source, scratch, dirs_exist_ok=True, symlinks=True)
                # The digest refuses links: taken before the move, a refused folder never replaces
                # the one stored under this key.
                stored = folder_digest(scratch)
                replace_dir(scratch, target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        return StoredObject(key, stored.sha256, stored.size_bytes)

    def fetch_dir(self, key: str, *, sha256: str) -> Path:
        target = self._path(key)
        if not target.is_dir():
            raise ObjectNotFound(f"no stored checkpoint {key!r} under {self.root}")
        found = folder_digest(target).sha256
        if found != sha256:
            raise ChecksumMismatch(f"{target}: contents have digest {found[:12]}…, expected {sha256[:12]}…")
        return target

    def delete(self, key: str) -> None:
        shutil.rmtree(self._path(key), ignore_errors=True)

    def stat(self, key: str) -> StoredObject | None:
        target = self._path(key)
        if not target.is_dir():
            return None
        stored = folder_digest(target)
        return StoredObject(key, stored.sha256, stored.size_bytes)

    def list_keys(self, prefix: str = "") -> list[str]:
        return sorted(key for key, _ in self._objects(prefix))

    def size(self, prefix: str) -> int:
        return sum(
            (Path(dirpath) / name).stat().st_size
            for _, folder in self._objects(prefix)
            for dirpath, _, filenames in os.walk(folder)
            for name in filenames
        )

    def remove_files(self, key: str, names: list[str]) -> StoredObject:
        target = self._path(key)
        if not target.is_dir():
            raise ObjectNotFound(f"no stored checkpoint {key!r} under {self.root}")
        for name in names:
            (target / check_key(name)).unlink(missing_ok=True)
        stored = folder_digest(target)
        return StoredObject(key, stored.sha256, stored.size_bytes)

    def _objects(self, prefix: str) -> list[tuple[str, Path]]:
        """(key, folder) of every stored object whose key starts with ``prefix``: a non-hidden
        folder holding files (not descended into). Scratch and old copies are hidden, so a
        half-written folder is never a key."""
        start = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not start.is_dir() or start.name.startswith("."):
            return []
        objects = []
        for dirpath, dirnames, filenames in os.walk(start):
            folder = Path(dirpath)
            key = folder.relative_to(self.root).as_posix()
            if folder != self.root and any((folder / name).is_file() for name in filenames):
                dirnames[:] = []
                if key.startswith(prefix):
                    objects.append((key, folder))
                continue
            dirnames[:] = sorted(name for name in dirnames if not name.startswith("."))
        return objects
