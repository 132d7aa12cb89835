"""The inference server's disk cache of fetched checkpoints: budget, LRU eviction, hit counting."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from training.serving.fetch_cache import FetchedCheckpoints, folder_bytes


class Store:
    """A stand-in for the checkpoint store's fetch: copies a source folder into ``cache/key`` by
    one rename (as the S3 store does) unless a copy is already there; counts downloads."""

    def __init__(self, sources: Path, cache: Path) -> None:
        self.sources, self.cache, self.downloads = sources, cache, []

    def add(self, key: str, size: int) -> None:
        folder = self.sources / key
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"x" * size)

    def fetch(self, key: str, sha256: str) -> Path:
        target = self.cache / key
        if target.is_dir():
            return target
        if not (self.sources / key).is_dir():
            raise FileNotFoundError(key)
        self.downloads.append(key)
        scratch = target.parent / f".{target.name}.{uuid.uuid4().hex}"
        shutil.copytree(self.sources / key, scratch)
        scratch.rename(target)
        return target


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "bucket", tmp_path / "cache")
    for step in (1, 2, 3):
        store.add(f"model-1/step-00000{step}", 1000)
    return store


def sample(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    return 0.0 if value is None else value


def test_beyond_the_budget_the_least_recently_used_checkpoint_is_evicted(store):
    one = folder_bytes(store.sources / "model-1/step-000001")
    cache = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=2 * one, grace_s=0)
    first = cache.get("model-1/step-000001", "a")
    cache.get("model-1/step-000002", "b")
    assert cache.get("model-1/step-000001", "a") == first  # step 1 is now the most recently used
    evictions_before = sample("artweb_inference_checkpoint_cache_evictions_total")
    cache.get("model-1/step-000003", "c")
    assert not (store.cache / "model-1/step-000002").exists(), "the least recently used one goes"
    assert (store.cache / "model-1/step-000001").is_dir() and (store.cache / "model-1/step-000003").is_dir()
    assert cache.used_bytes() == 2 * one <= cache.budget_bytes
    assert sample("artweb_inference_checkpoint_cache_evictions_total") == evictions_before + 1
    assert sample("artweb_inference_checkpoint_cache_bytes") == 2 * one
    assert not [p for p in (store.cache / "model-1").iterdir() if p.name.startswith(".")], "no leftovers"
    # Asked again, the evicted one is downloaded again (a miss), the others are hits.
    cache.get("model-1/step-000002", "b")
    assert store.downloads == ["model-1/step-000001", "model-1/step-000002", "model-1/step-000003",
                               "model-1/step-000002"]  # fmt: skip
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 4, 2)
    assert stats["hit_rate"] == 0.2 and stats["over_budget"] is False


def test_hits_and_misses_are_counted_for_prometheus(store):
    cache = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=0)
    hits, misses = (sample(f"artweb_inference_checkpoint_cache_{n}_total") for n in ("hits", "misses"))
    for _ in range(3):
        cache.get("model-1/step-000001", "a")
    assert sample("artweb_inference_checkpoint_cache_misses_total") == misses + 1
    assert sample("artweb_inference_checkpoint_cache_hits_total") == hits + 2
    assert sample("artweb_inference_checkpoint_cache_budget_bytes") == 0


def test_cached_answers_a_hit_without_downloading_and_a_miss_with_none(store):
    cache = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=0)
    assert cache.cached("model-1/step-000001", "a") is None and store.downloads == []
    fetched = cache.get("model-1/step-000001", "a")
    hits = sample("artweb_inference_checkpoint_cache_hits_total")
    assert cache.cached("model-1/step-000001", "a") == fetched
    assert sample("artweb_inference_checkpoint_cache_hits_total") == hits + 1
    assert cache.cached("model-1/step-000001", "another digest") is None
    assert store.downloads == ["model-1/step-000001"]


def test_a_folder_used_within_the_grace_period_is_not_evicted(store):
    one = folder_bytes(store.sources / "model-1/step-000001")
    cache = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=one, grace_s=3600)
    cache.get("model-1/step-000001", "a")
    cache.get("model-1/step-000002", "b")  # step 1 may be about to load in the engine: kept
    assert (store.cache / "model-1/step-000001").is_dir()
    assert cache.stats()["over_budget"] is True


def test_what_an_earlier_run_left_is_counted_and_trimmed_at_start(store):
    first = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=0)
    for step in (1, 2, 3):
        first.get(f"model-1/step-00000{step}", "x")
    one = folder_bytes(store.cache / "model-1/step-000001")
    restarted = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=2 * one)
    assert restarted.used_bytes() == 2 * one
    assert len(list((store.cache / "model-1").iterdir())) == 2
    # A copy on disk that the store verifies is a hit: no download.
    kept = next(p.name for p in (store.cache / "model-1").iterdir())
    downloads = len(store.downloads)
    restarted.get(f"model-1/{kept}", "x")
    assert len(store.downloads) == downloads and restarted.stats()["hits"] == 1


def test_folders_outside_the_cache_are_never_evicted(tmp_path, store):
    """The local store returns its own folders (what the trainer wrote): used, never deleted."""
    written = tmp_path / "checkpoints"
    shutil.copytree(store.sources, written)
    cache = FetchedCheckpoints(
        lambda key, sha256: written / key, root=tmp_path / "cache", budget_bytes=1, grace_s=0
    )
    for step in (1, 2, 3):
        assert (
            cache.get(f"model-1/step-00000{step}", "x") == (written / f"model-1/step-00000{step}").resolve()
        )
    assert all((written / f"model-1/step-00000{step}").is_dir() for step in (1, 2, 3))
    assert cache.used_bytes() == 0 and cache.stats()["evictions"] == 0
    assert cache.key_of(written / "model-1/step-000002") == "model-1/step-000002"


def test_without_a_cache_folder_nothing_is_owned(store):
    cache = FetchedCheckpoints(store.fetch, root=None, budget_bytes=1, grace_s=0)
    cache.get("model-1/step-000001", "a")
    cache.get("model-1/step-000002", "b")
    assert (store.cache / "model-1/step-000001").is_dir() and cache.stats()["evictions"] == 0


def test_a_fetch_error_passes_through_and_records_nothing(store):
    cache = FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=0)
    with pytest.raises(FileNotFoundError):
        cache.get("model-1/step-000009", "a")
    assert cache.stats()["checkpoints"] == 0


def test_a_negative_budget_is_refused(store):
    with pytest.raises(ValueError, match="budget"):
        FetchedCheckpoints(store.fetch, root=store.cache, budget_bytes=-1)


def test_concurrent_requests_for_one_checkpoint_download_it_once(store):
    import threading
    import time

    slow_fetch = store.fetch

    def fetch(key: str, sha256: str) -> Path:
        time.sleep(0.2)  # a download in progress while the other requests arrive
        return slow_fetch(key, sha256)

    cache = FetchedCheckpoints(fetch, root=store.cache, budget_bytes=0)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get("model-1/step-000001", "a")))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.downloads == ["model-1/step-000001"] and len(set(results)) == 1
    assert (cache.stats()["misses"], cache.stats()["hits"]) == (1, 3)
