"""Continuous batching: requests join the running decode batch at the next token, and leave it when done.

Invariant: one thread (the "engine" thread, started by `run`) owns the engine, the adapter cache
and the decode batch; it alone calls them. The event loop only queues requests, flags the ones
whose client went away, and resolves futures (the engine thread hands results and streamed tokens
over with `call_soon_threadsafe`, tokens before the result).

The engine thread loops: drop the rows of cancelled requests (a client that disconnects leaves the
batch before the next token), admit waiting requests, decode one token for every live row, resolve
the requests whose rows have all finished. A finished row leaves the batch at once, so its slot is
free for the next waiting request at the next token.

Admission is first come, first served, and head of line: waiting requests are admitted oldest
first while they fit (`max_batch_size` live sequences) and use the running batch's adapter; the
first one that does not stops admission, and nothing younger overtakes it. One decode batch serves
one adapter, so a request for another adapter makes the running batch drain (no new rows join it);
when it is empty a new batch starts with the oldest waiting request's adapter. No request starves:
each waits at most for the batches of the requests older than it. A saturated batch (more
sequences waiting than slots free) takes latecomers only once `join_min_free` slots are free
(default a quarter of the batch): a join costs the decode core a prefill pass and a copy of the KV
cache, and one join per step cost a fifth of the throughput when all 64 clients of the benchmark
arrived at once.

Sampling parameters are per request (the decode core takes them per `add`), seeds included: the
core gives every row its own generator, so a seeded request's output does not depend on its
batch-mates. When the engine is idle the first request waits `window_s` so that a burst of
requests is prefilled together: the engine thread is woken by a timer on the event loop, as the
window scheduler's is, so the window also covers requests the busy loop has not yet queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from training.engines.base import Choice, OnToken, SamplingParams, TokenDelta
from training.serving import metrics

log = logging.getLogger(__name__)


class DecodeBatchLike(Protocol):
    """What the scheduler needs of training.engines.decode.DecodeBatch (and what test doubles implement)."""

    def add(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        on_token: OnToken | None = None,
        grammars: Sequence[str | None] | None = None,
    ) -> list[int]: ...

    def step(self) -> list[tuple[int, Choice]]: ...

    def cancel(self, handle: int) -> None: ...

    @property
    def live(self) -> int: ...


# new_batch(adapter path or None) -> an empty decode batch for that adapter; runs on the engine
# thread (it may load the adapter).
NewBatchFn = Callable[[Path | None], DecodeBatchLike]


@dataclass(eq=False)
class _Request:
    prompts: list[list[int]]
    sampling: SamplingParams
    adapter: Path | None
    future: asyncio.Future[list[Choice]]
    loop: asyncio.AbstractEventLoop
    on_token: OnToken | None = None  # called on the event loop
    grammar: str | None = None  # constrains every sequence of the request
    # Engine thread only:
    handles: list[int] = field(default_factory=list)
    choices: dict[int, Choice] = field(default_factory=dict)  # handle -> its finished row
    cancelled: bool = False  # set on the event loop, read by the engine thread

    def resolve(self, result: list[Choice] | BaseException) -> None:
        """Hand the outcome to the event loop (from the engine thread)."""

        def settle() -> None:
            if self.future.done():  # the client went away
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            self.loop.call_soon_threadsafe(settle)


@dataclass
class ContinuousStats:
    """What /stats reports. A "batch" is one decode batch's life, from its first row to its drain:
    the same fields as the window scheduler's BatchStats, plus token steps and rows per step."""

    batches: int = 0
    requests: int = 0  # admitted into a batch (a request cancelled while waiting is not counted)
    sequences: int = 0
    busy_seconds: float = 0.0
    steps: int = 0  # decoding steps (one token for every live row)
    row_steps: int = 0  # sum over steps of the live rows
    joined_running: int = 0  # requests admitted into a batch that was already decoding
    cancelled: int = 0  # requests whose client left while they were in a batch
    requests_per_batch: dict[int, int] = field(default_factory=dict)  # histogram
    max_requests_in_batch: int = 0
    max_live_rows: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))

    def record_batch(self, requests: int, sequences: int, steps: int, seconds: float) -> None:
        self.batches += 1
        self.requests_per_batch[requests] = self.requests_per_batch.get(requests, 0) + 1
        self.max_requests_in_batch = max(self.max_requests_in_batch, requests)
        self.recent.append(
            {"requests": requests, "sequences": sequences, "steps": steps, "seconds": round(seconds, 4)}
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "scheduler": "continuous",
            "batches": self.batches,
            "requests": self.requests,
            "sequences": self.sequences,
            "mean_requests_per_batch": round(self.requests / self.batches, 3) if self.batches else 0.0,
            "max_requests_in_batch": self.max_requests_in_batch,
            "requests_per_batch": {str(k): v for k, v in sorted(self.requests_per_batch.items())},
            "busy_seconds": round(self.busy_seconds, 3),
            "steps": self.steps,
            "mean_rows_per_step": round(self.row_steps / self.steps, 3) if self.steps else 0.0,
            "max_live_rows": self.max_live_rows,
            "joined_running": self.joined_running,
            "cancelled": self.cancelled,
            "recent_batches": list(self.recent),
        }


@dataclass
class _Running:
    """The decode batch being decoded, with what it serves (engine thread only)."""

    batch: DecodeBatchLike
    adapter: Path | None
    owners: dict[int, _Request] = field(default_factory=dict)  # live handle -> its request
    requests: int = 0
    sequences: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)


class ContinuousScheduler:
    def __init__(
        self,
        new_batch: NewBatchFn,
        *,
        window_s: float = 0.01,
        max_batch_size: int = 32,
        join_min_free: int | None = None,
    ) -> None:
        self._new_batch = new_batch
        self.window_s = window_s
        self.max_batch_size = max_batch_size
        # While more sequences wait than there are free slots, rows join a decoding batch only once
        # this many slots are free: each join costs the decode core a prefill pass and a copy of the
        # KV cache, so a saturated batch takes latecomers in groups rather than one per step.
        self.join_min_free = join_min_free if join_min_free is not None else max(1, max_batch_size // 4)
        self.stats = ContinuousStats()
        self._lock = threading.Lock()  # guards _waiting and _wake between the loop and the engine thread
        self._waiting: deque[_Request] = deque()
        self._wake = threading.Event()
        self._idle = True  # the engine thread has no batch (it waits for _wake)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.running = 0  # requests with rows in the decode batch now
        self.live_rows = 0  # rows in the decode batch now

    @property
    def queued(self) -> int:
        """Requests waiting for a slot (not counting those whose client has gone)."""
        with self._lock:
            return sum(1 for request in self._waiting if not request.cancelled)

    async def submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapter: Path | None,
        on_token: OnToken | None = None,
        grammar: str | None = None,
    ) -> list[Choice]:
        """One Choice per prompt, in order, once all of them have finished; `on_token` sees each
        token before that. Cancelling the awaiting task takes the request out of the batch."""
        if not 1 <= len(prompts) <= self.max_batch_size:
            raise ValueError(f"a request must have 1 to {self.max_batch_size} sequences")
        loop = asyncio.get_running_loop()
        request = _Request(prompts, sampling, adapter, loop.create_future(), loop, on_token, grammar)
        with self._lock:
            self._waiting.append(request)
        if self._idle and self.window_s > 0:  # let a burst arrive and be prefilled together
            loop.call_later(self.window_s, self._wake.set)
        else:
            self._wake.set()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True  # the engine thread drops its rows before the next token
            self._wake.set()
            raise

    async def run(self) -> None:
        """Start the engine thread and keep it for the server's lifetime (run this as a task)."""
        previous = self._thread
        if previous is not None and previous.is_alive():  # a stopped run's thread may be mid-step
            await asyncio.get_running_loop().run_in_executor(None, previous.join)
        stop = self._stop = threading.Event()  # this run's own: a later run cannot revive the thread
        self._thread = threading.Thread(target=self._engine_loop, args=(stop,), name="generate", daemon=True)
        self._thread.start()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            stop.set()
            self._wake.set()
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for request in waiting:
                if not request.future.done():
                    request.future.set_exception(RuntimeError("the server is shutting down"))

    # ------------------------------------------------------------------ engine thread
    def _engine_loop(self, stop: threading.Event) -> None:
        running: _Running | None = None
        while not stop.is_set():
            if running is None:
                self._idle = True
                if not self._has_waiting():
                    self._wake.wait()
                    self._wake.clear()
                    if stop.is_set():
                        break
                    continue
                self._idle = False
            else:
                self._drop_cancelled(running)
            running = self._admit(running)
            if running is None:
                continue
            if running.batch.live == 0:
                self._retire(running)
                running = None
                continue
            try:
                finished = running.batch.step()
            except Exception as exc:
                log.exception("decoding failed")
                for request in set(running.owners.values()):
                    request.resolve(exc)
                running.owners.clear()
                self._retire(running)
                running = None
                continue
            running.steps += 1
            self.stats.steps += 1
            self.stats.row_steps += running.batch.live + len(finished)
            metrics.BATCH_SIZE.observe(running.batch.live + len(finished))
            completed = []
            for handle, choice in finished:
                owner = running.owners.pop(handle, None)
                if owner is None:  # cancelled in the meantime
                    continue
                owner.choices[handle] = choice
                if len(owner.choices) == len(owner.handles):
                    completed.append(owner)
            self._publish(running)
            if running.batch.live == 0:  # drained: its stats are in before its last results go out
                self._retire(running)
                running = None
            for owner in completed:
                owner.resolve([owner.choices[h] for h in owner.handles])
        # Stopped: whatever is still decoding is abandoned with the server.
        if running is not None:
            for request in set(running.owners.values()):
                request.resolve(RuntimeError("the server is shutting down"))

    def _has_waiting(self) -> bool:
        with self._lock:
            return bool(self._waiting)

    def _drop_cancelled(self, running: _Running) -> None:
        for request in {r for r in running.owners.values() if r.cancelled}:
            for handle in request.handles:
                if handle in running.owners:
                    del running.owners[handle]
                    running.batch.cancel(handle)
            self.stats.cancelled += 1
        self._publish(running)

    def _admit(self, running: _Running | None) -> _Running | None:
        """Admit waiting requests, oldest first, while they fit the batch (see the module doc)."""
        if running is not None and running.steps:
            free = self.max_batch_size - running.batch.live
            with self._lock:
                waiting = sum(len(r.prompts) for r in self._waiting if not r.cancelled)
            if free < min(waiting, self.join_min_free):
                return running  # saturated: let a few more slots free up first
        while True:
            with self._lock:
                while self._waiting and self._waiting[0].cancelled:
                    self._waiting.popleft()
                if not self._waiting:
                    return running
                request = self._waiting[0]
                live = running.batch.live if running is not None else 0
                if running is not None and (
                    request.adapter != running.adapter or live + len(request.prompts) > self.max_batch_size
                ):
                    return running  # head of line: it waits for the drain (or free slots)
                self._waiting.popleft()
            if running is None:
                try:
                    running = _Running(self._new_batch(request.adapter), request.adapter)
                except Exception as exc:  # e.g. an adapter that cannot be loaded
                    request.resolve(exc)
                    continue
            elif running.steps:
                self.stats.joined_running += 1
            grammars = [request.grammar] * len(request.prompts) if request.grammar is not None else None
            try:
                request.handles = running.batch.add(
                    request.prompts, request.sampling, on_token=self._router(request), grammars=grammars
                )
            except Exception as exc:
                request.resolve(exc)
                continue
            for handle in request.handles:
                running.owners[handle] = request
            running.requests += 1
            running.sequences += len(request.prompts)
            self.stats.requests += 1
            self.stats.sequences += len(request.prompts)
            self._publish(running)

    def _retire(self, running: _Running) -> None:
        """Record a drained (or failed) batch's life; the caller drops it."""
        seconds = time.perf_counter() - running.started
        self.stats.busy_seconds += seconds
        if running.requests:
            self.stats.record_batch(running.requests, running.sequences, running.steps, seconds)
        self.running = self.live_rows = 0

    def _publish(self, running: _Running) -> None:
        self.live_rows = running.batch.live
        self.running = len(set(running.owners.values()))
        self.stats.max_live_rows = max(self.stats.max_live_rows, self.live_rows)

    @staticmethod
    def _router(request: _Request) -> OnToken | None:
        """An on_token for the engine thread that hands each token to the request's callback on
        the event loop, with `index` counted within the request (the decode core counts it within
        the `add` call, which is the same: one `add` per request)."""
        on_token = request.on_token
        if on_token is None:
            return None

        def route(delta: TokenDelta) -> None:
            if request.cancelled:
                return
            with contextlib.suppress(RuntimeError):
                request.loop.call_soon_threadsafe(_deliver, request, on_token, replace(delta))

        return route


def _deliver(request: _Request, on_token: OnToken, delta: TokenDelta) -> None:
    if not request.future.done():  # done: the client went away
        on_token(delta)
