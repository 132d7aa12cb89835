"""Retention and deletion against the S3 store (projects.storage.S3CheckpointStore on moto's
in-process S3): a deleted checkpoint, a deleted model and the optimizer state of an older
checkpoint leave the bucket (its objects listed before and after), the row's digest follows
the folder, and the API's storage_bytes is what the bucket holds."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest
from django.db import transaction
from moto import mock_aws

from projects import services, storage
from projects.models import Checkpoint, Run, RunStatus
from tests import factories
from tests.projects.api.test_checkpoints_retention import write_folder

BUCKET, PREFIX = "checkpoints", "artweb"


@pytest.fixture
def s3(settings, tmp_path: Path):
    storage._store.cache_clear()  # a client made outside this mock must not be reused
    with mock_aws():
        settings.STORAGE_BACKEND = "s3"
        settings.STORAGE_S3_BUCKET, settings.STORAGE_S3_PREFIX = BUCKET, PREFIX
        settings.STORAGE_S3_ENDPOINT_URL, settings.STORAGE_S3_REGION = "", "us-east-1"
        settings.STORAGE_S3_ACCESS_KEY_ID = settings.STORAGE_S3_SECRET_ACCESS_KEY = "test"
        settings.CHECKPOINT_DIR = tmp_path / "cache"
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client
    storage._store.cache_clear()


def objects(client, prefix: str) -> list[str]:
    """Object names in the bucket under ``PREFIX/prefix``, as S3 lists them."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/{prefix}")
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def upload(model, run, step: int, worker_dir: Path) -> Checkpoint:
    """What a worker does: write the folder, put it in the store, record the row with its key."""
    folder = write_folder(worker_dir, model.pk, step)
    stored = storage.checkpoint_store().put_dir(storage.checkpoint_key(model_id=model.pk, step=step), folder)
    checkpoint = services.checkpoint_record(model=model, run=run, step=step, path=str(folder))
    Checkpoint.objects.filter(pk=checkpoint.pk).update(
        storage_key=stored.key, sha256=stored.sha256, size_bytes=stored.size_bytes
    )
    checkpoint.refresh_from_db()
    return checkpoint


def test_deleting_a_checkpoint_or_its_model_empties_the_bucket(
    s3, alpha_setup, alice_client, tmp_path, django_capture_on_commit_callbacks
):
    model = alpha_setup.model
    checkpoints = [upload(model, None, step, tmp_path / "worker") for step in range(3)]
    one = f"model-{model.pk}/step-000001"
    assert any(name.startswith(f"{PREFIX}/{one}/") for name in objects(s3, one))
    shown = alice_client.get(f"/api/v1/models/{model.pk}").json()["storage_bytes"]
    # What the bucket holds: the folders' files and each one's manifest.
    assert (
        shown
        == storage.checkpoint_store().size(f"model-{model.pk}/")
        > sum(c.size_bytes for c in checkpoints)
    )
    with django_capture_on_commit_callbacks(execute=True):
        assert alice_client.delete(f"/api/v1/checkpoints/{checkpoints[1].pk}").status_code == 204
    assert objects(s3, one) == []
    assert objects(s3, f"model-{model.pk}/step-000000") and objects(s3, f"model-{model.pk}/step-000002")
    with django_capture_on_commit_callbacks(execute=True):
        assert alice_client.delete(f"/api/v1/models/{model.pk}").status_code == 204
    assert objects(s3, f"model-{model.pk}/") == []


def test_an_older_checkpoint_keeps_only_its_adapter_in_the_bucket(
    s3, alpha_setup, tmp_path, django_capture_on_commit_callbacks
):
    model = alpha_setup.model
    run = factories.RunFactory(
        model=model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    first = upload(model, run, 0, tmp_path / "worker")
    folder = write_folder(tmp_path / "worker", model.pk, 1)
    with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        services.steps.step_rows_write(run=locked, step=1, metrics={}, trajectories=[], path=str(folder))
    names = [name.rsplit("/", 1)[1] for name in objects(s3, f"model-{model.pk}/step-000000/")]
    assert "adapter_model.safetensors" in names
    assert "optimizer.pt" not in names and "rng_state.pt" not in names
    first.refresh_from_db()
    stored = storage.checkpoint_store().stat(first.storage_key)
    assert stored is not None and (first.sha256, first.size_bytes) == (stored.sha256, stored.size_bytes)
    fetched = storage.checkpoint_local_dir(first)  # the new digest verifies
    assert fetched is not None and (fetched / "adapter_model.safetensors").is_file()
