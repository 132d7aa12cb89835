"""Windowed batching and the adapter LRU, with a recording stand-in for the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from training.engines.base import Choice, SamplingParams, TokenDelta
from training.serving.adapters import AdapterCache, adapter_name, check_adapter_path
from training.serving.protocol import RequestError
from training.serving.scheduler import BatchScheduler


class RecordingGenerate:
    """Echoes each prompt back; records every call and the thread it ran on."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.calls: list[tuple[int, SamplingParams, Path | None]] = []
        self.grammars: list[list[str | None] | None] = []
        self.threads: set[str] = set()
        self.seconds = seconds

    def __call__(self, prompts, sampling, adapter, on_token=None, grammars=None):
        self.calls.append((len(prompts), sampling, adapter))
        self.grammars.append(grammars)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        return [Choice(text="", prompt_token_ids=p, token_ids=list(p), logprobs=[0.0], finish_reason="stop")
                for p in prompts]  # fmt: skip


async def run_with(scheduler: BatchScheduler, *submissions):
    task = asyncio.create_task(scheduler.run())
    try:
        return await asyncio.gather(*(scheduler.submit(*s) for s in submissions), return_exceptions=True)
    finally:
        task.cancel()


def test_concurrent_compatible_requests_share_one_engine_call():
    generate = RecordingGenerate()
    scheduler = BatchScheduler(generate, window_s=0.02, max_batch_size=32)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    results = asyncio.run(run_with(scheduler, *[([[i]] * 2, sampling, None) for i in range(1, 7)]))
    assert [len(generate.calls), generate.calls[0][0]] == [1, 12]  # 6 requests x n=2 in one call
    # Each request gets its own sequences back, in order.
    assert [[c.token_ids for c in r] for r in results] == [[[i], [i]] for i in range(1, 7)]
    assert scheduler.stats.as_dict()["requests_per_batch"] == {"6": 1}
    assert generate.threads == {"generate_0"}  # never on the event loop


def test_incompatible_requests_and_seeded_requests_are_not_merged(tmp_path):
    generate = RecordingGenerate()
    scheduler = BatchScheduler(generate, window_s=0.02)
    hot, cold = SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)
    seeded = SamplingParams(temperature=1.0, seed=3)
    asyncio.run(
        run_with(
            scheduler,
            ([[1]], hot, None), ([[2]], hot, None), ([[3]], cold, None), ([[4]], hot, tmp_path),
            ([[5]], seeded, None), ([[6]], seeded, None),
        )
    )  # fmt: skip
    sizes = sorted(size for size, _, _ in generate.calls)
    assert sizes == [1, 1, 1, 1, 2]  # only the two plain `hot` requests were merged


def test_constrained_and_free_requests_share_a_batch_each_row_with_its_own_grammar():
    generate = RecordingGenerate()
    scheduler = BatchScheduler(generate, window_s=0.02)
    sampling = SamplingParams()
    asyncio.run(
        run_with(
            scheduler, ([[1]] * 2, sampling, None, None, "json"), ([[2]], sampling, None), ([[3]], sampling, None, None, "other"),
        )
    )  # fmt: skip
    assert [size for size, _, _ in generate.calls] == [4]
    assert generate.grammars == [["json", "json", None, "other"]]
    asyncio.run(run_with(BatchScheduler(generate, window_s=0.02), ([[4]], sampling, None)))
    assert generate.grammars[-1] is None  # no grammar in the batch: none passed


def test_max_batch_size_splits_a_burst():
    generate = RecordingGenerate()
    scheduler = BatchScheduler(generate, window_s=0.02, max_batch_size=4)
    asyncio.run(run_with(scheduler, *[([[i]] * 2, SamplingParams(), None) for i in range(5)]))
    assert [size for size, _, _ in generate.calls] == [4, 4, 2]


def test_requests_arriving_during_a_batch_form_the_next_one():
    generate = RecordingGenerate(seconds=0.2)
    scheduler = BatchScheduler(generate, window_s=0.01)

    async def scenario():
        task = asyncio.create_task(scheduler.run())
        first = asyncio.create_task(scheduler.submit([[0]], SamplingParams(), None))
        await asyncio.sleep(0.05)  # the first batch is running now
        later = [asyncio.create_task(scheduler.submit([[i]], SamplingParams(), None)) for i in range(1, 4)]
        await asyncio.gather(first, *later)
        task.cancel()

    asyncio.run(scenario())
    assert [size for size, _, _ in generate.calls] == [1, 3]


def test_an_engine_error_fails_only_its_batch():
    def generate(prompts, sampling, adapter, on_token=None, grammars=None):
        if sampling.temperature == 0.5:
            raise RuntimeError("boom")
        return RecordingGenerate(0)(prompts, sampling, adapter)

    scheduler = BatchScheduler(generate, window_s=0.01)
    bad, good = asyncio.run(run_with(scheduler, ([[1]], SamplingParams(temperature=0.5), None),
                                     ([[2]], SamplingParams(), None)))  # fmt: skip
    assert isinstance(bad, RuntimeError)
    assert good[0].token_ids == [2]


class FakeEngine:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def load_adapter(self, name, path):
        self.events.append(("load", Path(path).name))

    def unload_adapter(self, name):
        self.events.append(("unload", name))


def test_adapters_load_on_first_use_and_the_least_recently_used_is_evicted(tmp_path):
    engine = FakeEngine()
    cache = AdapterCache(engine, capacity=2)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    name_a = cache.acquire(a)
    cache.acquire(b)
    assert cache.acquire(a) == name_a  # a hit: no load; a is now the most recent
    cache.acquire(c)  # evicts b, the least recently used, first
    assert engine.events == [("load", "a"), ("load", "b"), ("unload", adapter_name(b)), ("load", "c")]
    assert cache.loaded() == [str(a), str(c)]
    assert (cache.loads, cache.evictions) == (3, 1)


def test_only_adapter_paths_inside_the_checkpoint_root_are_accepted(tmp_path):
    root = tmp_path / "checkpoints"
    good = root / "model-1" / "step-1"
    good.mkdir(parents=True)
    (good / "adapter_config.json").write_text("{}")
    assert check_adapter_path(str(good), root) == good.resolve()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (root / "link").symlink_to(outside)
    for path in (str(outside), str(root / "model-1" / ".." / ".." / "elsewhere"), str(root / "link")):
        with pytest.raises(RequestError) as error:
            check_adapter_path(path, root)
        assert error.value.status == 403
    with pytest.raises(RequestError) as error:
        check_adapter_path(str(root / "model-1"), root)
    assert error.value.status == 404


def test_streamed_tokens_reach_their_own_request_with_its_own_indices_before_the_result():
    def generate(prompts, sampling, adapter, on_token=None, grammars=None):
        assert sampling.top_logprobs == 4  # the largest k in the batch
        for row, prompt in enumerate(prompts):
            if on_token:
                on_token(TokenDelta(row, prompt[0], -1.0, [], f"t{prompt[0]}", "length"))
        return RecordingGenerate(0)(prompts, sampling, adapter)

    scheduler = BatchScheduler(generate, window_s=0.02)
    seen: list[tuple[int, str]] = []

    async def scenario():
        task = asyncio.create_task(scheduler.run())
        try:

            def on_token(delta):
                seen.append((delta.index, delta.text))

            streamed = scheduler.submit([[7], [8]], SamplingParams(top_logprobs=4), None, on_token)
            plain = scheduler.submit([[5]], SamplingParams(top_logprobs=1), None)
            results = await asyncio.gather(plain, streamed)
            assert seen == [(0, "t7"), (1, "t8")]  # already there when the result came
            return results
        finally:
            task.cancel()

    plain, streamed = asyncio.run(scenario())
    assert [c.token_ids for c in streamed] == [[7], [8]] and plain[0].token_ids == [5]
    assert scheduler.stats.batches == 1
