"""What every checkpoint store shares: keys, the folder digest, and the verified local cache.

Invariants:
- a stored object is a folder; its ``sha256`` is the digest of its *contents* (``folder_digest``),
  so the local store, the S3 store and a cached copy are all checked against the same number;
- ``fetch_dir`` returns a folder only after its digest equals the one asked for; a copy that does
  not match (corrupted, partial, from an older upload under the same key) is never returned;
- a cached copy appears at its final path in one rename (``replace_dir``): readers see the old
  folder, or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from training.session.checkpoint_files import move_into_place

# Keys are relative POSIX paths of plain segments: they become object names and cache folders.
# Matched with fullmatch: with match and "$", a segment ending in a newline would pass.
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]*")
_CHUNK = 1024 * 1024


class StorageError(Exception):
    """The store cannot do what was asked (bad key, unreachable backend)."""


class ObjectNotFound(StorageError):
    """No stored object under this key."""


class ChecksumMismatch(StorageError):
    """A folder's contents do not have the digest the caller asked for: refused."""


@dataclass(frozen=True)
class StoredObject:
    """A stored folder: its key, the digest of its contents and their total size in bytes."""

    key: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative POSIX path inside the folder
    size: int
    sha256: str


def check_key(key: str) -> str:
    """``key`` if it is a relative path of plain segments ("model-3/step-000002"), else StorageError."""
    segments = key.split("/")
    if not key or not all(_SEGMENT.fullmatch(segment) for segment in segments):
        raise StorageError(f"invalid storage key {key!r}: use relative segments of letters, digits and ._=+-")
    return key


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_files(local_dir: Path) -> list[FileEntry]:
    """Every regular file under ``local_dir``, sorted by relative path. Symlinks are refused: a
    checkpoint folder holds plain files, and a link could smuggle in a file from elsewhere."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise ObjectNotFound(f"{local_dir} is not a folder")
    entries = []
    for dirpath, dirnames, filenames in os.walk(local_dir):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                raise StorageError(f"{path}: only plain files can be stored")
            relative = path.relative_to(local_dir).as_posix()
            entries.append(FileEntry(relative, path.stat().st_size, file_sha256(path)))
    for dirpath, dirnames, _ in os.walk(local_dir):
        for name in dirnames:
            if (Path(dirpath) / name).is_symlink():
                raise StorageError(f"{Path(dirpath) / name}: only plain files can be stored")
    return sorted(entries, key=lambda entry: entry.path)


def manifest_digest(files: list[FileEntry]) -> str:
    """The digest of a folder from its file list: sha256 over "path NUL size NUL sha256 LF" lines
    in path order. Changing, adding, removing or renaming any file changes it."""
    digest = hashlib.sha256()
    for entry in sorted(files, key=lambda entry: entry.path):
        digest.update(f"{entry.path}\0{entry.size}\0{entry.sha256}\n".encode())
    return digest.hexdigest()


def folder_digest(local_dir: Path) -> StoredObject:
    """The digest and size of ``local_dir`` (key left empty)."""
    files = folder_files(local_dir)
    return StoredObject("", manifest_digest(files), sum(entry.size for entry in files))


def replace_dir(scratch: Path, target: Path) -> None:
    """Move the complete folder ``scratch`` to ``target`` (replacing one there) by renames only."""
    target.parent.mkdir(parents=True, exist_ok=True)
    move_into_place(scratch, target)


def scratch_dir(target: Path, purpose: str) -> Path:
    """A fresh hidden sibling of ``target`` (same file system, so the final rename is atomic).
    Hidden names (leading dot) are never listed as keys."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{target.name}.{purpose}-{uuid.uuid4().hex}"
    scratch.mkdir()
    return scratch


class CheckpointStore:
    """Folders (checkpoints, exports) stored under keys such as ``model-3/step-000002``.

    Subclasses: ``LocalCheckpointStore`` (embedded default) and ``S3CheckpointStore``. Every method
    is safe to call from several processes at once; ``put_dir`` to one key from two writers at
    once is not (the last manifest wins, and a reader asking for the other digest is refused).
    """

    #: the folder under which ``fetch_dir`` returns copies: ``cache_dir / key``
    cache_dir: Path

    def put_dir(self, key: str, local_dir: Path) -> StoredObject:
        """Store the folder ``local_dir`` under ``key`` (replacing what was there) and return
        what was stored. When it returns, the object is complete and readable from any host."""
        raise NotImplementedError

    def fetch_dir(self, key: str, *, sha256: str) -> Path:
        """A local folder holding the object ``key`` whose digest is ``sha256``: the cached copy
        when it verifies, else a fresh download. ChecksumMismatch if the stored object is not the
        one asked for; ObjectNotFound if there is none. Do not write into the returned folder."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove the object ``key`` and its cached copy; nothing to remove is not an error."""
        raise NotImplementedError

    def list_keys(self, prefix: str = "") -> list[str]:
        """Keys of complete objects starting with ``prefix`` (a plain string prefix: end it with
        "/" to mean a folder, "model-3/" does not match "model-30/..."), sorted."""
        raise NotImplementedError

    def size(self, prefix: str) -> int:
        """Bytes stored under keys starting with ``prefix``."""
        raise NotImplementedError

    def stat(self, key: str) -> StoredObject | None:
        """What is stored under ``key``, or None."""
        raise NotImplementedError

    def remove_files(self, key: str, names: list[str]) -> StoredObject:
        """Drop the files ``names`` (relative paths, e.g. ``["optimizer.pt", "rng_state.pt"]``)
        from the stored object ``key`` and return it as it is now (new digest and size): for an
        old checkpoint that no resume needs, keeping only its adapter. Absent names are ignored."""
        raise NotImplementedError

    def cache_path(self, key: str) -> Path:
        """Where ``fetch_dir`` puts (or finds) the local copy of ``key``."""
        return Path(self.cache_dir) / check_key(key)
