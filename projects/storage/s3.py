"""An S3-compatible bucket (AWS S3, MinIO, moto's server) with a verified local cache.

Layout: one object per file, ``<prefix>/<key>/<relative path>``, and a manifest
``<prefix>/<key>/.manifest.json`` (``{"format": 1, "sha256", "size_bytes", "files": [{path,
size, sha256}]}``) uploaded **last**: an object without a manifest is incomplete and not listed.
Per file rather than one archive so that ``remove_files`` can drop the optimizer state of an old
checkpoint without re-uploading its adapter, and ``size`` is the bucket's own byte count.

``fetch_dir`` downloads into a hidden scratch folder beside ``cache_dir/key``, checks each file
against the manifest and the whole folder against the digest asked for, then renames it into
place; a download cut short leaves only a scratch folder, which is never returned or listed.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from projects.storage.base import (
    CheckpointStore,
    ChecksumMismatch,
    FileEntry,
    ObjectNotFound,
    StorageError,
    StoredObject,
    check_key,
    file_sha256,
    folder_digest,
    folder_files,
    manifest_digest,
    replace_dir,
    scratch_dir,
)

logger = logging.getLogger(__name__)

MANIFEST = ".manifest.json"
FETCH_ATTEMPTS = 2  # a download that fails its check is fetched once more before giving up


class S3CheckpointStore(CheckpointStore):
    def __init__(self, *, client: Any, bucket: str, prefix: str, cache_dir: Path) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.cache_dir = Path(cache_dir)

    # ------------------------------------------------------------------ names
    def _object_prefix(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}/" if self.prefix else f"{key}/"

    def _key_of(self, object_name: str) -> str:
        return object_name[len(self.prefix) + 1 :] if self.prefix else object_name

    # ------------------------------------------------------------------ writes
    def put_dir(self, key: str, local_dir: Path) -> StoredObject:
        base = self._object_prefix(key)
        files = folder_files(Path(local_dir))
        if any(entry.path == MANIFEST for entry in files):
            raise StorageError(f"{local_dir}: a stored folder cannot hold a file named {MANIFEST}")
        stored = StoredObject(key, manifest_digest(files), sum(entry.size for entry in files))
        previous = self._manifest(key)
        if previous is not None and previous["sha256"] == stored.sha256:
            return stored  # already there (a retried upload)
        for entry in files:
            self.client.upload_file(str(Path(local_dir) / entry.path), self.bucket, base + entry.path)
        self._write_manifest(key, files)
        kept = {entry.path for entry in files}
        stale = [f for f in (previous or {}).get("files", []) if f["path"] not in kept]
        self._delete_objects([base + f["path"] for f in stale])
        return stored

    def _write_manifest(self, key: str, files: list[FileEntry]) -> None:
        body = {
            "format": 1,
            "sha256": manifest_digest(files),
            "size_bytes": sum(entry.size for entry in files),
            "files": [entry.__dict__ for entry in files],
        }
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._object_prefix(key) + MANIFEST,
            Body=json.dumps(body, sort_keys=True).encode(),
            ContentType="application/json",
        )

    def delete(self, key: str) -> None:
        base = self._object_prefix(key)
        # The manifest first: from then on the object is incomplete, so never fetched or listed.
        self._delete_objects([base + MANIFEST])
        self._delete_objects(self._object_names(base))
        shutil.rmtree(self.cache_path(key), ignore_errors=True)

    def remove_files(self, key: str, names: list[str]) -> StoredObject:
        manifest = self._manifest(key)
        if manifest is None:
            raise ObjectNotFound(f"no stored checkpoint {key!r} in s3://{self.bucket}/{self.prefix}")
        drop = {check_key(name) for name in names}
        files = [FileEntry(**f) for f in manifest["files"] if f["path"] not in drop]
        if len(files) != len(manifest["files"]):
            self._write_manifest(key, files)  # the new digest is in force before the files go
            self._delete_objects([self._object_prefix(key) + name for name in drop])
            for name in drop:  # the cached copy follows, so it still verifies
                (self.cache_path(key) / name).unlink(missing_ok=True)
        return StoredObject(key, manifest_digest(files), sum(entry.size for entry in files))

    # ------------------------------------------------------------------ reads
    def stat(self, key: str) -> StoredObject | None:
        manifest = self._manifest(key)
        if manifest is None:
            return None
        return StoredObject(key, manifest["sha256"], int(manifest["size_bytes"]))

    def list_keys(self, prefix: str = "") -> list[str]:
        keys = []
        for name in self._object_names(self._search_prefix(prefix)):
            if name.endswith("/" + MANIFEST):
                key = self._key_of(name)[: -len(MANIFEST) - 1]
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def size(self, prefix: str) -> int:
        total = 0
        for page in self._pages(self._search_prefix(prefix)):
            for item in page.get("Contents", []):
                if self._key_of(item["Key"]).startswith(prefix):
                    total += int(item["Size"])
        return total

    def fetch_dir(self, key: str, *, sha256: str) -> Path:
        target = self.cache_path(key)
        if target.is_dir():
            try:
                if folder_digest(target).sha256 == sha256:
                    return target
            except StorageError:
                pass
            logger.warning("cached copy of %s does not match its digest: fetching it again", key)
        manifest = self._manifest(key)
        if manifest is None:
            raise ObjectNotFound(f"no stored checkpoint {key!r} in s3://{self.bucket}/{self.prefix}")
        files = [FileEntry(**f) for f in manifest["files"]]
        if manifest_digest(files) != sha256:
            raise ChecksumMismatch(
                f"stored checkpoint {key!r} has digest {manifest_digest(files)[:12]}…, expected {sha256[:12]}…"
            )
        last_error: ChecksumMismatch | None = None
        for _ in range(FETCH_ATTEMPTS):
            try:
                self._download(key, files, target)
                return target
            except ChecksumMismatch as exc:
                logger.warning("download of %s refused: %s", key, exc)
                last_error = exc
        assert last_error is not None
        raise last_error

    def _download(self, key: str, files: list[FileEntry], target: Path) -> None:
        base = self._object_prefix(key)
        scratch = scratch_dir(target, "fetch")
        try:
            for entry in files:
                local = scratch / entry.path
                local.parent.mkdir(parents=True, exist_ok=True)
                self.client.download_file(self.bucket, base + entry.path, str(local))
                size = local.stat().st_size
                if size != entry.size or file_sha256(local) != entry.sha256:
                    raise ChecksumMismatch(
                        f"{entry.path}: downloaded {size} bytes that do not match the manifest"
                    )
            replace_dir(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # ------------------------------------------------------------------ S3 calls
    def _search_prefix(self, prefix: str) -> str:
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def _manifest(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._object_prefix(key) + MANIFEST)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise StorageError(f"s3://{self.bucket}: {exc}") from exc
        return dict(json.loads(response["Body"].read()))

    def _pages(self, prefix: str) -> Any:
        return self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)

    def _object_names(self, prefix: str) -> list[str]:
        return [item["Key"] for page in self._pages(prefix) for item in page.get("Contents", [])]

    def _delete_objects(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 names
            batch = names[start : start + 1000]
            if batch:
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": name} for name in batch], "Quiet": True}
                )
