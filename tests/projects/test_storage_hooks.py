"""Workers write checkpoints through projects.storage: the row is written only after the folder
is stored, and carries its key, digest and size; resuming reads through the store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from projects import services
from projects.jobs.runs import DjangoRunHooks
from projects.models import Checkpoint
from projects.storage import StorageError, checkpoint_key, checkpoint_local_dir, folder_digest
from tests.factories import RunFactory
from tests.projects.test_storage import checkpoint_folder


@pytest.fixture
def claimed_run(db, settings, tmp_path):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    run = RunFactory()
    run = services.run_claim(run_id=run.pk, worker="w1")
    assert run is not None
    return run


def hooks_for(run) -> DjangoRunHooks:
    return DjangoRunHooks(run, "w1", SimpleNamespace(lost=False))


def test_checkpoint_row_records_what_was_stored(claimed_run, settings):
    folder = checkpoint_folder(settings.CHECKPOINT_DIR / f"model-{claimed_run.model_id}" / "step-000000")
    hooks_for(claimed_run).record_checkpoint(step=0, path=folder, metrics={})
    row = Checkpoint.objects.get(model=claimed_run.model, step=0)
    expected = folder_digest(folder)
    assert row.storage_key == checkpoint_key(model_id=claimed_run.model_id, step=0)
    assert (row.sha256, row.size_bytes) == (expected.sha256, expected.size_bytes)
    assert row.path == str(folder)  # the local default: the path is the stored folder itself
    assert checkpoint_local_dir(row) == folder


def test_no_row_when_the_upload_fails(claimed_run, settings, monkeypatch):
    import projects.jobs.runs as runs_module

    def failing_upload(**_):
        raise StorageError("bucket unreachable")

    monkeypatch.setattr(runs_module, "checkpoint_upload", failing_upload)
    folder = checkpoint_folder(settings.CHECKPOINT_DIR / "x" / "step-000001")
    hooks = hooks_for(claimed_run)
    with pytest.raises(StorageError):
        hooks.record_checkpoint(step=0, path=folder, metrics={})
    with pytest.raises(StorageError):
        hooks.record_step(step=1, metrics={"reward_mean": 0.5}, trajectories=[], path=folder)
    assert not Checkpoint.objects.filter(model=claimed_run.model).exists()
    claimed_run.refresh_from_db()
    assert claimed_run.current_step == 0  # the step is not recorded either


def test_record_step_stores_then_records(claimed_run, settings):
    folder = checkpoint_folder(settings.CHECKPOINT_DIR / f"model-{claimed_run.model_id}" / "step-000001")
    assert hooks_for(claimed_run).record_step(
        step=1, metrics={"reward_mean": 0.5}, trajectories=[], path=folder
    )
    row = Checkpoint.objects.get(model=claimed_run.model, step=1)
    assert row.sha256 == folder_digest(folder).sha256
    assert row.storage_key == f"model-{claimed_run.model_id}/step-000001"


def test_a_checkpoint_without_a_key_is_read_from_its_path(db):
    legacy = SimpleNamespace(storage_key="", sha256="", path="/data/checkpoints/model-1/step-000003")
    assert str(checkpoint_local_dir(legacy)) == "/data/checkpoints/model-1/step-000003"  # type: ignore[arg-type]
    assert checkpoint_local_dir(SimpleNamespace(storage_key="", sha256="", path="")) is None  # type: ignore[arg-type]
