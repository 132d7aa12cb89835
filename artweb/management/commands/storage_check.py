"""``manage.py storage_check [--create-bucket]``: prove the checkpoint store works from this host.

Stores a small probe folder, fetches it back into a fresh cache, checks its digest and deletes it
(projects.storage). Exits non-zero with the backend's own error otherwise, so it serves as a
start-up check (the compose file's web service runs it before serving). ``--create-bucket``
creates a missing S3 bucket first: for a MinIO started next to the stack, not for a cloud bucket
an operator provisions.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Store, fetch and delete a probe folder through the configured checkpoint store."

    def add_arguments(self, parser):
        parser.add_argument("--create-bucket", action="store_true", help="create a missing S3 bucket first")

    def handle(self, *args, create_bucket: bool, **options):
        from projects.storage import S3CheckpointStore, StorageError, checkpoint_store

        with tempfile.TemporaryDirectory(prefix="artweb-storage-check-") as scratch:
            store = checkpoint_store(cache_dir=Path(scratch) / "cache")
            where = str(settings.CHECKPOINT_DIR)
            try:
                if isinstance(store, S3CheckpointStore):
                    where = f"s3://{store.bucket}/{store.prefix}"
                    if create_bucket:
                        _create_bucket(store)
                started = time.monotonic()
                probe = Path(scratch) / "probe"
                probe.mkdir()
                (probe / "probe.txt").write_text("artweb storage check\n")
                key = f"storage-check/probe-{uuid.uuid4().hex}"
                stored = store.put_dir(key, probe)
                try:
                    fetched = store.fetch_dir(key, sha256=stored.sha256)
                    if (fetched / "probe.txt").read_text() != "artweb storage check\n":
                        raise StorageError("the fetched probe differs from what was stored")
                finally:
                    store.delete(key)
            except Exception as exc:  # botocore's errors name the endpoint and the reason
                raise CommandError(f"checkpoint storage at {where} does not work: {exc}") from exc
        elapsed_ms = (time.monotonic() - started) * 1000
        self.stdout.write(f"checkpoint storage ok: {where} (store, fetch, delete in {elapsed_ms:.0f} ms)")


def _create_bucket(store) -> None:
    from botocore.exceptions import ClientError

    try:
        store.client.head_bucket(Bucket=store.bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
        store.client.create_bucket(Bucket=store.bucket)
