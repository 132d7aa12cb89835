"""projects.storage: the local store and the S3 store (against moto's real HTTP server, run in a
thread), the digest they share, and the verified cache: a corrupted or partial copy is refused
and fetched again; a download that does not match is never returned."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from projects.storage import (
    CheckpointStore,
    ChecksumMismatch,
    LocalCheckpointStore,
    ObjectNotFound,
    S3CheckpointStore,
    StorageError,
    checkpoint_key,
    checkpoint_store,
    folder_digest,
)

KEY = checkpoint_key(model_id=3, step=2)


@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )


@pytest.fixture
def bucket(s3_endpoint, request) -> str:
    name = "ckpt-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
    s3_client(s3_endpoint).create_bucket(Bucket=name)
    return name


def s3_store(endpoint: str, bucket: str, cache: Path) -> S3CheckpointStore:
    return S3CheckpointStore(client=s3_client(endpoint), bucket=bucket, prefix="artweb", cache_dir=cache)


def checkpoint_folder(path: Path, seed: int = 1) -> Path:
    """A folder shaped like a trainer's checkpoint (sizes are what matters, not the contents)."""
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(os.urandom(1000 + seed))
    (path / "adapter_config.json").write_text('{"r": 4}')
    (path / "optimizer.pt").write_bytes(os.urandom(3000))
    (path / "state.json").write_text(f'{{"step": {seed}}}')
    return path


def contents(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


# ----------------------------------------------------------------------------- the digest


def test_digest_changes_with_any_file_and_ignores_where_the_folder_is(tmp_path):
    first = checkpoint_folder(tmp_path / "a")
    copy = tmp_path / "b"
    copy.mkdir()
    for name, data in contents(first).items():
        (copy / name).write_bytes(data)
    assert folder_digest(first) == folder_digest(copy)
    (copy / "state.json").write_text('{"step": 9}')
    assert folder_digest(copy).sha256 != folder_digest(first).sha256
    (copy / "state.json").write_bytes((first / "state.json").read_bytes())
    (copy / "state.json").rename(copy / "state2.json")  # a rename changes it too
    assert folder_digest(copy).sha256 != folder_digest(first).sha256


def test_bad_keys_are_refused(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    for key in ("", "../etc", "model-1/../../x", "/abs", "model-1//step", ".hidden/x"):
        with pytest.raises(StorageError):
            store.put_dir(key, tmp_path)


# ----------------------------------------------------------------------------- local


def test_local_store_keeps_the_trainers_folder_in_place(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    folder = checkpoint_folder(tmp_path / KEY)
    stored = store.put_dir(KEY, folder)
    assert stored.sha256 == folder_digest(folder).sha256
    assert stored.size_bytes == sum(len(data) for data in contents(folder).values())
    assert store.fetch_dir(KEY, sha256=stored.sha256) == folder
    assert store.stat(KEY) == stored


def test_a_folder_with_a_link_is_refused_and_leaves_the_stored_folder_as_it_was(tmp_path):
    store = LocalCheckpointStore(tmp_path / "root")
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / "good"))
    linked = checkpoint_folder(tmp_path / "linked", seed=2)
    (linked / "secrets.txt").symlink_to(tmp_path / "outside.txt")
    (tmp_path / "outside.txt").write_text("not part of any checkpoint")
    with pytest.raises(StorageError):
        store.put_dir(KEY, linked)
    assert store.fetch_dir(KEY, sha256=stored.sha256) == tmp_path / "root" / KEY
    assert not (tmp_path / "root" / KEY / "secrets.txt").is_symlink()


def test_local_store_copies_a_folder_from_elsewhere_and_lists_by_prefix(tmp_path):
    store = LocalCheckpointStore(tmp_path / "root")
    for model, step in ((3, 1), (3, 2), (30, 1)):
        store.put_dir(
            checkpoint_key(model_id=model, step=step), checkpoint_folder(tmp_path / f"src-{model}-{step}")
        )
    assert store.list_keys("model-3/") == ["model-3/step-000001", "model-3/step-000002"]
    assert store.list_keys() == ["model-3/step-000001", "model-3/step-000002", "model-30/step-000001"]
    one = folder_digest(tmp_path / "root" / "model-3" / "step-000001").size_bytes
    two = folder_digest(tmp_path / "root" / "model-3" / "step-000002").size_bytes
    assert store.size("model-3/") == one + two
    store.delete("model-3/step-000001")
    store.delete("model-3/step-000001")  # idempotent
    assert store.list_keys("model-3/") == ["model-3/step-000002"]


def test_local_store_refuses_a_corrupted_checkpoint(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / KEY))
    with open(tmp_path / KEY / "adapter_model.safetensors", "r+b") as handle:
        handle.write(b"\x00\x01")
    with pytest.raises(ChecksumMismatch):
        store.fetch_dir(KEY, sha256=stored.sha256)
    with pytest.raises(ObjectNotFound):
        store.fetch_dir("model-3/step-000099", sha256=stored.sha256)


def test_local_store_ignores_half_written_scratch_folders(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    checkpoint_folder(tmp_path / "model-3" / ".step-000004.tmp-abc")  # a trainer killed mid-save
    store.put_dir(KEY, checkpoint_folder(tmp_path / KEY))
    assert store.list_keys("model-3/") == [KEY]


def test_remove_files_keeps_the_adapter_and_reports_the_new_digest(tmp_path):
    store = LocalCheckpointStore(tmp_path)
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / KEY))
    slim = store.remove_files(KEY, ["optimizer.pt", "rng_state.pt"])
    assert slim.size_bytes == stored.size_bytes - 3000
    assert slim.sha256 == folder_digest(tmp_path / KEY).sha256 != stored.sha256
    assert sorted(contents(store.fetch_dir(KEY, sha256=slim.sha256))) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "state.json",
    ]


# ----------------------------------------------------------------------------- S3


def test_s3_round_trip_into_another_hosts_cache(tmp_path, s3_endpoint, bucket):
    writer = s3_store(s3_endpoint, bucket, tmp_path / "writer")
    folder = checkpoint_folder(tmp_path / "writer" / KEY)
    stored = writer.put_dir(KEY, folder)
    assert stored.sha256 == folder_digest(folder).sha256  # the same digest as the local store's
    reader = s3_store(s3_endpoint, bucket, tmp_path / "reader")
    fetched = reader.fetch_dir(KEY, sha256=stored.sha256)
    assert fetched == tmp_path / "reader" / KEY
    assert contents(fetched) == contents(folder)
    assert reader.list_keys("model-3/") == [KEY] and reader.list_keys("model-30/") == []
    assert reader.stat(KEY) == stored
    # The bucket's bytes: the files plus the manifest.
    assert stored.size_bytes < reader.size("model-3/") < stored.size_bytes + 2000


def test_s3_delete_removes_every_object_and_is_idempotent(tmp_path, s3_endpoint, bucket):
    store = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / "src"))
    store.fetch_dir(KEY, sha256=stored.sha256)
    store.delete(KEY)
    store.delete(KEY)
    assert s3_client(s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount") == 0
    assert not (tmp_path / "cache" / KEY).exists()
    with pytest.raises(ObjectNotFound):
        store.fetch_dir(KEY, sha256=stored.sha256)


def test_s3_corrupted_cache_copy_is_refused_and_fetched_again(tmp_path, s3_endpoint, bucket):
    source = checkpoint_folder(tmp_path / "src")
    stored = s3_store(s3_endpoint, bucket, tmp_path / "w").put_dir(KEY, source)
    reader = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    cached = reader.fetch_dir(KEY, sha256=stored.sha256)
    with open(cached / "adapter_model.safetensors", "r+b") as handle:  # a flipped byte, same size
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))
    assert reader.fetch_dir(KEY, sha256=stored.sha256) == cached
    assert contents(cached) == contents(source)


def test_s3_partial_cache_copy_is_fetched_again(tmp_path, s3_endpoint, bucket):
    source = checkpoint_folder(tmp_path / "src")
    stored = s3_store(s3_endpoint, bucket, tmp_path / "w").put_dir(KEY, source)
    reader = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    cached = reader.fetch_dir(KEY, sha256=stored.sha256)
    (cached / "optimizer.pt").unlink()  # a copy missing a file
    with open(cached / "adapter_model.safetensors", "r+b") as handle:  # and one cut short
        handle.truncate(10)
    assert contents(reader.fetch_dir(KEY, sha256=stored.sha256)) == contents(source)


def test_s3_download_that_does_not_match_is_refused_and_leaves_nothing(tmp_path, s3_endpoint, bucket):
    stored = s3_store(s3_endpoint, bucket, tmp_path / "w").put_dir(KEY, checkpoint_folder(tmp_path / "src"))
    # The object in the bucket cut short (an upload interrupted by another writer, bit rot).
    s3_client(s3_endpoint).put_object(
        Bucket=bucket, Key=f"artweb/{KEY}/adapter_model.safetensors", Body=b"only the first bytes"
    )
    reader = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    with pytest.raises(ChecksumMismatch, match="adapter_model.safetensors"):
        reader.fetch_dir(KEY, sha256=stored.sha256)
    parent = tmp_path / "cache" / "model-3"
    assert not (parent / "step-000002").exists()
    assert list(parent.iterdir()) == []  # no scratch folder left behind


def test_s3_fetch_for_another_digest_is_refused_before_downloading(tmp_path, s3_endpoint, bucket):
    writer = s3_store(s3_endpoint, bucket, tmp_path / "w")
    old = writer.put_dir(KEY, checkpoint_folder(tmp_path / "old", seed=1))
    writer.put_dir(KEY, checkpoint_folder(tmp_path / "new", seed=2))  # the same key written again
    reader = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    with pytest.raises(ChecksumMismatch):
        reader.fetch_dir(KEY, sha256=old.sha256)
    assert not (tmp_path / "cache" / KEY).exists()


def test_s3_scratch_of_a_killed_fetch_is_never_a_key(tmp_path, s3_endpoint, bucket):
    store = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / "src"))
    scratch = tmp_path / "cache" / "model-3" / ".step-000002.fetch-dead"
    scratch.mkdir(parents=True)
    (scratch / "adapter_model.safetensors").write_bytes(b"half")
    assert store.fetch_dir(KEY, sha256=stored.sha256) == tmp_path / "cache" / KEY
    assert store.list_keys() == [KEY]


def test_s3_remove_files_updates_the_manifest_and_the_cached_copy(tmp_path, s3_endpoint, bucket):
    store = s3_store(s3_endpoint, bucket, tmp_path / "cache")
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / "src"))
    store.fetch_dir(KEY, sha256=stored.sha256)
    slim = store.remove_files(KEY, ["optimizer.pt", "rng_state.pt"])
    assert slim.size_bytes == stored.size_bytes - 3000
    assert store.stat(KEY) == slim
    names = [o["Key"] for o in s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert f"artweb/{KEY}/optimizer.pt" not in names
    # The cached copy still verifies (nothing fetched again), and a fresh host gets the slim one.
    assert "optimizer.pt" not in contents(store.fetch_dir(KEY, sha256=slim.sha256))
    other = s3_store(s3_endpoint, bucket, tmp_path / "other")
    assert sorted(contents(other.fetch_dir(KEY, sha256=slim.sha256))) == sorted(
        contents(tmp_path / "cache" / KEY)
    )


# ----------------------------------------------------------------------------- settings


def test_checkpoint_store_follows_the_settings(settings, tmp_path, s3_endpoint, bucket):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    local = checkpoint_store()
    assert isinstance(local, LocalCheckpointStore) and local.root == tmp_path / "checkpoints"
    settings.STORAGE_BACKEND = "s3"
    settings.STORAGE_S3_BUCKET = bucket
    settings.STORAGE_S3_PREFIX = "team-install"
    settings.STORAGE_S3_ENDPOINT_URL = s3_endpoint
    settings.STORAGE_S3_ACCESS_KEY_ID = "test"
    settings.STORAGE_S3_SECRET_ACCESS_KEY = "test"
    store: CheckpointStore = checkpoint_store(cache_dir=tmp_path / "cache")
    assert isinstance(store, S3CheckpointStore)
    stored = store.put_dir(KEY, checkpoint_folder(tmp_path / "src"))
    keys = [o["Key"] for o in s3_client(s3_endpoint).list_objects_v2(Bucket=bucket)["Contents"]]
    assert f"team-install/{KEY}/.manifest.json" in keys
    assert store.fetch_dir(KEY, sha256=stored.sha256) == tmp_path / "cache" / KEY
