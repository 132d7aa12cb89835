"""Storage of checkpoints (and exports): one interface, a local folder by default, an S3-compatible
bucket in production.

    store = checkpoint_store()                      # configured from settings (below)
    stored = store.put_dir(checkpoint_key(model_id=3, step=2), folder)   # StoredObject(key, sha256, size_bytes)
    folder = store.fetch_dir(stored.key, sha256=stored.sha256)           # a verified local copy
    store.remove_files(key, ["optimizer.pt", "rng_state.pt"])           # keep only the adapter
    store.delete(key)                                                    # idempotent
    store.list_keys("model-3/"); store.size("model-3/"); store.stat(key)

What an object is: a **folder** (a checkpoint directory as ``training.session.policy.Policy.save_checkpoint`` writes it, an export).
Its ``sha256`` is the digest of its contents (``base.manifest_digest``: sha256 over the sorted
"path NUL size NUL file-sha256" lines), the same number for every backend and for a cached copy.
Keys are relative paths: ``checkpoint_key`` gives ``model-<id>/step-<NNNNNN>``, the layout of
``CHECKPOINT_DIR`` (exports and other objects of a model should live under ``model_prefix(id)`` so
that ``size``/``list_keys`` of the model count them and deleting a model can find them).

Backends (``STORAGE_BACKEND``):
- ``local`` (default, embedded): objects are the folders ``CHECKPOINT_DIR/<key>`` themselves, so the
  trainer's own output is stored without a copy and ``Checkpoint.path`` stays that folder.
- ``s3``: one object per file plus a manifest uploaded last (``s3.py``), in ``STORAGE_S3_BUCKET``
  under ``STORAGE_S3_PREFIX``; ``STORAGE_S3_ENDPOINT_URL`` for MinIO and other non-AWS servers;
  credentials ``STORAGE_S3_ACCESS_KEY_ID`` / ``STORAGE_S3_SECRET_ACCESS_KEY`` (or ``*_FILE``; empty:
  boto3's own chain: env, instance role). ``fetch_dir`` caches under ``CHECKPOINT_DIR/<key>`` of the
  host, which is also where a trainer writes: a worker's own checkpoints are already cached.

Errors: ``StorageError`` (bad key, backend failure), ``ObjectNotFound``, ``ChecksumMismatch`` (a
corrupted or partial copy, or a stored object that is not the one the row names: refused).

Readers take the key and digest from the row (``Checkpoint.storage_key`` / ``sha256``, see
``checkpoint_local_dir``): ``Checkpoint.path`` is the folder on the host that wrote it. Whoever
changes a stored folder (``remove_files``) writes the returned digest and size back to its row.

This package is Django-side (settings); ``training`` never imports it: callers pass the folder a
fetch returned, or ``store.fetch_dir`` as a plain callable.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from projects.storage.base import (
    CheckpointStore,
    ChecksumMismatch,
    ObjectNotFound,
    StorageError,
    StoredObject,
    folder_digest,
)
from projects.storage.local import LocalCheckpointStore
from projects.storage.s3 import S3CheckpointStore

if TYPE_CHECKING:
    from projects.models import Checkpoint

__all__ = [
    "ChecksumMismatch",
    "CheckpointStore",
    "LocalCheckpointStore",
    "ObjectNotFound",
    "S3CheckpointStore",
    "StorageError",
    "StoredObject",
    "checkpoint_key",
    "checkpoint_local_dir",
    "checkpoint_store",
    "checkpoint_upload",
    "folder_digest",
    "model_prefix",
]


def checkpoint_key(*, model_id: int, step: int) -> str:
    """The key of a trainable model's checkpoint at ``step`` (its folder name under CHECKPOINT_DIR)."""
    return f"{model_prefix(model_id)}step-{step:06d}"


def model_prefix(model_id: int) -> str:
    """The prefix of every object of one trainable model (for ``size`` and ``list_keys``)."""
    return f"model-{model_id}/"


def checkpoint_store(*, cache_dir: Path | None = None) -> CheckpointStore:
    """The store the settings describe; ``cache_dir`` (default ``CHECKPOINT_DIR``) is where an S3
    store puts fetched copies (the local store has no copies: its objects are the folders under
    ``CHECKPOINT_DIR``). The same instance is returned for the same settings."""
    cache = Path(cache_dir if cache_dir is not None else settings.CHECKPOINT_DIR)
    return _store(
        settings.STORAGE_BACKEND,
        str(settings.CHECKPOINT_DIR),
        str(cache),
        settings.STORAGE_S3_BUCKET,
        settings.STORAGE_S3_PREFIX,
        settings.STORAGE_S3_ENDPOINT_URL,
        settings.STORAGE_S3_REGION,
        settings.STORAGE_S3_ACCESS_KEY_ID,
        settings.STORAGE_S3_SECRET_ACCESS_KEY,
    )


@functools.lru_cache(maxsize=8)
def _store(
    backend: str,
    checkpoint_dir: str,
    cache_dir: str,
    bucket: str,
    prefix: str,
    endpoint_url: str,
    region: str,
    access_key_id: str,
    secret_access_key: str,
) -> CheckpointStore:
    if backend == "local":
        return LocalCheckpointStore(Path(checkpoint_dir))
    if backend != "s3":
        raise ImproperlyConfigured(f"STORAGE_BACKEND={backend!r} must be local or s3")
    if not bucket:
        raise ImproperlyConfigured("STORAGE_BACKEND=s3 needs STORAGE_S3_BUCKET")
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint_url or None,
        region_name=region or None,
        aws_access_key_id=access_key_id or None,
        aws_secret_access_key=secret_access_key or None,
        # Path-style addressing for MinIO-like servers (no wildcard DNS for bucket hosts).
        config=Config(
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            retries={"max_attempts": 5, "mode": "standard"},
        ),
    )
    return S3CheckpointStore(client=client, bucket=bucket, prefix=prefix, cache_dir=Path(cache_dir))


def checkpoint_upload(*, model_id: int, step: int, folder: Path) -> StoredObject:
    """Store the checkpoint folder a trainer just wrote under its key: call it before writing the
    row (``Checkpoint.storage_key/sha256/size_bytes`` from the result). In S3 mode the folder is
    this host's CHECKPOINT_DIR/<key>, i.e. already the cached copy: nothing is fetched back."""
    return checkpoint_store().put_dir(checkpoint_key(model_id=model_id, step=step), Path(folder))


def checkpoint_local_dir(checkpoint: Checkpoint, *, cache_dir: Path | None = None) -> Path | None:
    """A verified local folder holding ``checkpoint``'s files (fetched into the cache when needed),
    or None for a checkpoint without files (a client model's untrained step 0). Rows recorded
    before storage keys existed are read from their ``path``."""
    if checkpoint.storage_key:
        return checkpoint_store(cache_dir=cache_dir).fetch_dir(
            checkpoint.storage_key, sha256=checkpoint.sha256
        )
    return Path(checkpoint.path) if checkpoint.path else None
