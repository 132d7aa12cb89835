"""Continuous batching (training.serving.continuous) with a recording stand-in for the decode core:
joining at the next token, leaving on cancel, the adapter policy, and no request lost."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from training.engines.base import Choice, SamplingParams, TokenDelta
from training.serving.continuous import ContinuousScheduler


class Recorder:
    """What every fake decode batch did, and on which thread."""

    def __init__(self, step_s: float = 0.002, fail_on_token: int | None = None) -> None:
        self.step_s = step_s
        self.fail_on_token = fail_on_token
        self.batches: list[FakeDecodeBatch] = []
        self.threads: set[str] = set()
        self.events: list[tuple[str, Any]] = []  # ("add", prompt tokens), ("cancel", handle), ...

    def new_batch(self, adapter: Path | None) -> FakeDecodeBatch:
        self.threads.add(threading.current_thread().name)
        batch = FakeDecodeBatch(self, adapter)
        self.batches.append(batch)
        self.events.append(("batch", adapter))
        return batch


class FakeDecodeBatch:
    """Implements DecodeBatch's contract: each row samples its prompt's last token, one per step,
    until its max_new_tokens; `on_token` gets `index` counted within the `add` call."""

    def __init__(self, recorder: Recorder, adapter: Path | None) -> None:
        self.recorder = recorder
        self.adapter = adapter
        self.rows: dict[int, dict[str, Any]] = {}
        self.next_handle = 0
        self.steps = 0
        self.live_per_step: list[int] = []

    def add(self, prompts, sampling, *, on_token=None, grammars=None):
        self.recorder.threads.add(threading.current_thread().name)
        handles = []
        for index, prompt in enumerate(prompts):
            handle = self.next_handle
            self.next_handle += 1
            self.rows[handle] = {"prompt": prompt, "sampling": sampling, "on_token": on_token,
                                 "index": index, "tokens": [], "grammar": grammars[index] if grammars else None}  # fmt: skip
            handles.append(handle)
            self.recorder.events.append(("add", (prompt[-1], self.steps)))
        return handles

    def step(self):
        self.recorder.threads.add(threading.current_thread().name)
        time.sleep(self.recorder.step_s)
        self.steps += 1
        self.live_per_step.append(len(self.rows))
        finished = []
        for handle, row in list(self.rows.items()):
            token = row["prompt"][-1]
            if token == self.recorder.fail_on_token:
                raise RuntimeError("boom")
            row["tokens"].append(token)
            done = len(row["tokens"]) == row["sampling"].max_new_tokens
            if row["on_token"] is not None:
                row["on_token"](
                    TokenDelta(row["index"], token, -1.0, [], f"t{token}", "length" if done else None)
                )
            if done:
                del self.rows[handle]
                self.recorder.events.append(("finish", token))
                finished.append((handle, Choice(text=row["grammar"] or "", prompt_token_ids=row["prompt"],
                                                token_ids=row["tokens"], logprobs=[-1.0] * len(row["tokens"]),
                                                finish_reason="length")))  # fmt: skip
        return finished

    def cancel(self, handle):
        self.recorder.threads.add(threading.current_thread().name)
        self.recorder.events.append(("cancel", self.rows.pop(handle)["prompt"][-1]))

    @property
    def live(self):
        return len(self.rows)


def tokens(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


async def until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def scenario(scheduler: ContinuousScheduler, body):
    async def main():
        task = asyncio.create_task(scheduler.run())
        try:
            return await body()
        finally:
            task.cancel()

    return asyncio.run(main())


def test_a_late_short_request_joins_the_running_batch_and_finishes_before_an_early_long_one():
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0)
    done: list[str] = []

    async def body():
        async def submit(name, token, n):
            result = await scheduler.submit([[token]], tokens(n), None)
            done.append(name)
            return result

        long = asyncio.create_task(submit("long", 1, 200))
        await until(lambda: recorder.batches and recorder.batches[0].steps >= 5)  # the long one decodes
        short = await submit("short", 2, 3)
        assert not long.done()
        return await long, short

    long, short = scenario(scheduler, body)
    assert done == ["short", "long"]
    assert [long[0].token_ids, short[0].token_ids] == [[1] * 200, [2] * 3]
    [batch] = recorder.batches  # it joined the running batch, not a later one
    joined_at = next(
        step for kind, (token, step) in (e for e in recorder.events if e[0] == "add") if token == 2
    )
    assert joined_at >= 5 and batch.live_per_step.count(2) == 3  # two rows for exactly its 3 tokens
    assert (scheduler.stats.batches, scheduler.stats.joined_running, scheduler.stats.requests) == (1, 1, 2)


def test_cancelling_a_request_frees_its_slot_and_the_next_waiting_request_starts():
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0, max_batch_size=2)

    async def body():
        first = asyncio.create_task(scheduler.submit([[1]], tokens(10_000), None))
        second = asyncio.create_task(scheduler.submit([[2]], tokens(60), None))
        await until(lambda: scheduler.live_rows == 2)
        third = asyncio.create_task(scheduler.submit([[3]], tokens(5), None))
        await until(lambda: scheduler.queued == 1)
        await asyncio.sleep(0.02)
        assert scheduler.queued == 1 and scheduler.live_rows == 2  # the batch is full: it waits
        first.cancel()  # its client went away
        result = await third
        assert not second.done()  # the third started in the freed slot while the second decodes
        await second
        with pytest.raises(asyncio.CancelledError):
            await first
        return result

    result = scenario(scheduler, body)
    assert result[0].token_ids == [3] * 5
    kinds = [(kind, value if kind != "add" else value[0]) for kind, value in recorder.events]
    assert kinds.index(("cancel", 1)) < kinds.index(("add", 3)) < kinds.index(("finish", 2))
    assert max(recorder.batches[0].live_per_step) == 2 and scheduler.stats.cancelled == 1
    assert ("finish", 1) not in kinds  # the cancelled row never decoded to its end


def test_a_saturated_batch_takes_latecomers_in_groups_not_one_per_step():
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0, max_batch_size=4, join_min_free=2)

    async def body():
        running = [asyncio.create_task(scheduler.submit([[token]], tokens(n), None))
                   for token, n in ((1, 5), (2, 8), (3, 60), (4, 60))]  # fmt: skip
        await until(lambda: recorder.batches and recorder.batches[0].steps >= 1 and scheduler.live_rows == 4)
        late = [asyncio.create_task(scheduler.submit([[token]], tokens(3), None)) for token in (5, 6, 7)]
        await asyncio.gather(*running, *late)

    scenario(scheduler, body)
    joined = {
        token: step for kind, (token, step) in (e for e in recorder.events if e[0] == "add") if token > 4
    }
    # One slot free after step 5 is not enough while three wait; two free after step 8 are.
    assert joined[5] == joined[6] == 8 and joined[7] > 8
    assert max(recorder.batches[0].live_per_step) == 4


def test_a_request_cancelled_while_waiting_is_never_decoded():
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0, max_batch_size=1)

    async def body():
        busy = asyncio.create_task(scheduler.submit([[1]], tokens(30), None))
        await until(lambda: scheduler.live_rows == 1)
        waiting = asyncio.create_task(scheduler.submit([[2]], tokens(5), None))
        await until(lambda: scheduler.queued == 1)
        waiting.cancel()
        await until(lambda: scheduler.queued == 0)
        await busy

    scenario(scheduler, body)
    assert [value[0] for kind, value in recorder.events if kind == "add"] == [1]
    assert scheduler.stats.requests == 1


def test_a_request_for_another_adapter_drains_the_batch_and_is_not_overtaken(tmp_path):
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0)
    x, y = tmp_path / "x", tmp_path / "y"

    async def body():
        first = asyncio.create_task(scheduler.submit([[1]], tokens(40), x))
        await until(lambda: scheduler.live_rows == 1)
        other = asyncio.create_task(scheduler.submit([[2]], tokens(5), y))
        await until(lambda: scheduler.queued == 1)
        same = asyncio.create_task(scheduler.submit([[3]], tokens(5), x))  # younger than `other`
        await asyncio.gather(first, other, same)

    scenario(scheduler, body)
    assert [e for e in recorder.events if e[0] == "batch"] == [("batch", x), ("batch", y), ("batch", x)]
    finished = [value for kind, value in recorder.events if kind == "finish"]
    assert finished == [1, 2, 3]  # the running batch drained; y ran next; x's latecomer waited its turn
    assert [len(b.live_per_step) and max(b.live_per_step) for b in recorder.batches] == [1, 1, 1]


def test_no_request_is_lost_under_64_concurrent_clients():
    recorder = Recorder(step_s=0.0005)
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.001, max_batch_size=16)
    rng = random.Random(0)
    plans = [(client, rng.randint(1, 3), rng.randint(1, 40), rng.random() < 0.5) for client in range(64)]
    streamed: dict[int, list[tuple[int, str]]] = {client: [] for client in range(64)}

    async def body():
        async def client(number, n, max_new, stream):
            await asyncio.sleep(rng.random() * 0.05)
            on_token = (lambda delta: streamed[number].append((delta.index, delta.text))) if stream else None
            prompts = [[1000 * number + index] for index in range(n)]
            return await scheduler.submit(prompts, tokens(max_new), None, on_token)

        return await asyncio.gather(*(client(*plan) for plan in plans))

    results = scenario(scheduler, body)
    for (number, n, max_new, stream), choices in zip(plans, results, strict=True):
        assert [c.token_ids for c in choices] == [[1000 * number + index] * max_new for index in range(n)]
        if stream:  # every token of every sequence, with the request's own indices
            assert sorted(streamed[number]) == sorted(
                (index, f"t{1000 * number + index}") for index in range(n) for _ in range(max_new)
            )
    assert scheduler.stats.requests == 64 and scheduler.stats.sequences == sum(p[1] for p in plans)
    assert max(max(b.live_per_step) for b in recorder.batches) <= 16
    assert scheduler.stats.joined_running > 0
    assert scheduler.queued == 0 and scheduler.running == 0


def test_one_thread_owns_the_decode_batch_and_it_is_not_the_event_loop():
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0)

    async def body():
        loop_thread = threading.current_thread().name
        task = asyncio.create_task(scheduler.submit([[1]], tokens(50), None))
        await until(lambda: scheduler.live_rows == 1)
        await asyncio.gather(*(scheduler.submit([[2]], tokens(3), None) for _ in range(3)))
        task.cancel()
        await until(lambda: scheduler.live_rows == 0)
        return loop_thread

    loop_thread = scenario(scheduler, body)
    assert len(recorder.threads) == 1 and loop_thread not in recorder.threads


def test_streamed_tokens_arrive_on_the_loop_before_the_result():
    recorder = Recorder()
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0)
    seen: list[tuple[int, str]] = []

    async def body():
        result = await scheduler.submit([[7], [8]], tokens(2), None, lambda d: seen.append((d.index, d.text)))
        assert sorted(seen) == [(0, "t7"), (0, "t7"), (1, "t8"), (1, "t8")]  # already there
        return result

    result = scenario(scheduler, body)
    assert [c.token_ids for c in result] == [[7, 7], [8, 8]]


def test_a_decoding_error_fails_the_batch_and_the_next_request_gets_a_fresh_one():
    recorder = Recorder(fail_on_token=9)
    scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0)

    async def body():
        bad = await asyncio.gather(scheduler.submit([[9]], tokens(3), None), return_exceptions=True)
        good = await scheduler.submit([[2]], tokens(3), None)
        return bad, good

    (bad,), good = scenario(scheduler, body)
    assert isinstance(bad, RuntimeError) and good[0].token_ids == [2, 2, 2]
    assert len(recorder.batches) == 2


def test_a_batch_that_cannot_start_fails_only_its_request(tmp_path):
    recorder = Recorder()

    def new_batch(adapter):
        if adapter is not None:
            raise FileNotFoundError("no such checkpoint")
        return recorder.new_batch(adapter)

    scheduler = ContinuousScheduler(new_batch, window_s=0.0)

    async def body():
        return await asyncio.gather(
            scheduler.submit([[1]], tokens(2), tmp_path), scheduler.submit([[2]], tokens(2), None),
            return_exceptions=True,
        )  # fmt: skip

    bad, good = scenario(scheduler, body)
    assert isinstance(bad, FileNotFoundError) and good[0].token_ids == [2, 2]


# ---------------------------------------------------------------------- through the ASGI app


async def post(app, body: dict[str, Any], leave: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """POST /v1/chat/completions; the client disconnects when `leave` is set. Returns what was sent."""
    sent: list[dict[str, Any]] = []
    delivered = False
    leave = leave or asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(
        {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send
    )
    return sent


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_leaves_the_decode_batch_at_once(engine, tmp_path, stream):
    from training.serving.app import InferenceApp, ServerConfig

    recorder = Recorder()
    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path, batch_window_s=0.0))
    app.scheduler = ContinuousScheduler(recorder.new_batch, window_s=0.0)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000,
            "stream": stream}  # fmt: skip

    async def main():
        task = asyncio.create_task(app.scheduler.run())
        try:
            leave = asyncio.Event()
            request = asyncio.create_task(post(app, body, leave))
            await until(lambda: app.scheduler.live_rows == 1)
            leave.set()
            sent = await asyncio.wait_for(request, 5)
            await until(lambda: app.scheduler.live_rows == 0)
            return sent
        finally:
            task.cancel()

    sent = asyncio.run(main())
    assert [kind for kind, _ in recorder.events if kind in ("cancel", "finish")] == ["cancel"]
    assert recorder.batches[0].steps < 4000 and app.scheduler.stats.cancelled == 1
    bodies = b"".join(m.get("body", b"") for m in sent)
    assert b"[DONE]" not in bodies and b'"choices"' not in bodies.split(b"\n\n")[-1]
    if not stream:
        assert sent == []  # nobody to answer


def test_the_window_scheduler_stays_selectable(engine, tmp_path):
    from training.serving.app import InferenceApp, ServerConfig
    from training.serving.scheduler import BatchScheduler

    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path, scheduler="window"))
    assert isinstance(app.scheduler, BatchScheduler) and app.stats()["scheduler"] == "window"
    with pytest.raises(ValueError, match="scheduler must be one of"):
        InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path, scheduler="fifo"))


def test_a_seeded_request_that_joins_a_running_batch_samples_what_it_samples_alone(engine, tmp_path):
    """On the real decode core (tiny model): joining mid-decode, next to other rows, changes nothing."""
    from training.serving.app import InferenceApp, ServerConfig

    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path, batch_window_s=0.0))
    scheduler = app.scheduler
    assert isinstance(scheduler, ContinuousScheduler)
    prompt = engine.render([{"role": "user", "content": "Count to ten."}])
    seeded = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, top_logprobs=2)

    async def alone():
        return await scheduler.submit([prompt], seeded, None)

    async def joining():
        other = engine.render([{"role": "user", "content": "Something longer, please, much longer."}])
        busy = asyncio.create_task(scheduler.submit([other, other], SamplingParams(max_new_tokens=80), None))
        steps = scheduler.stats.steps
        await until(lambda: scheduler.live_rows == 2 and scheduler.stats.steps >= steps + 5)  # it decodes
        result = await scheduler.submit([prompt], seeded, None)
        assert not busy.done()
        await busy
        return result

    [first] = scenario(scheduler, alone)
    [second] = scenario(scheduler, joining)
    assert second.token_ids == first.token_ids and len(first.token_ids) == 12
    assert second.logprobs == pytest.approx(first.logprobs, abs=1e-4)
    assert scheduler.stats.joined_running == 1
