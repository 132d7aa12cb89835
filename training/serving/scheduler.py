"""Windowed batching: concurrent requests become one engine call per compatible group.

Not the server's default: `serve_inference` uses continuous batching (training.serving.continuous).
This scheduler stays selectable (`--scheduler window`, the INFERENCE_SCHEDULER setting,
ServerConfig.scheduler) as the reference benchmarks/serving_batching.py measures against, and for
engines without a decode core.

Invariant: exactly one generation runs at a time, in one worker thread (the engine and the adapter
cache are not thread-safe, and one batched call uses the CPU better than two racing ones); the
event loop only queues, groups and resolves futures, so it stays responsive while a batch runs.

When the engine is idle, the first request waits `window_s` for others to join it. Requests that
arrive while a batch runs join the next batch, which starts as soon as the running one ends. A
batch holds requests with the same adapter and sampling parameters (one engine call takes one
SamplingParams), up to `max_batch_size` sequences; a request with a seed is never batched with
another, so its output does not depend on what else was running. Requests that differ only in
`top_logprobs` share a batch, which reports the largest k asked for (each response shows its own).

Streaming: a request submitted with `on_token` gets each of its sequences' tokens as they are
sampled (TokenDelta, `index` counted within the request), delivered on the event loop while the
batch goes on; its result still comes back whole when the batch ends.

A request's `grammar` (constrained decoding, training.engines.grammar) is not part of its batch
key: the engine masks each row with its own grammar, so constrained and free requests share a batch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from training.engines.base import Choice, OnToken, SamplingParams, TokenDelta
from training.serving import metrics

# generate(prompts, sampling, adapter path or None, on_token or None, grammars or None) -> one
# Choice per prompt; runs in the worker thread and calls on_token there, for every sequence, if it
# is given. `grammars` holds one grammar or None per prompt, or is None when no row is constrained.
GenerateFn = Callable[
    [list[list[int]], SamplingParams, Path | None, OnToken | None, list[str | None] | None], list[Choice]
]


@dataclass
class _Job:
    prompts: list[list[int]]
    sampling: SamplingParams
    adapter: Path | None
    key: Hashable
    future: asyncio.Future[list[Choice]]
    on_token: OnToken | None = None  # called on the event loop
    grammar: str | None = None  # constrains every sequence of the request


@dataclass
class BatchStats:
    """What /stats reports: how many engine calls ran and how large they were."""

    batches: int = 0
    requests: int = 0
    sequences: int = 0
    busy_seconds: float = 0.0
    requests_per_batch: dict[int, int] = field(default_factory=dict)  # histogram
    max_requests_in_batch: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))

    def record(self, requests: int, sequences: int, seconds: float) -> None:
        self.batches += 1
        self.requests += requests
        self.sequences += sequences
        self.busy_seconds += seconds
        self.requests_per_batch[requests] = self.requests_per_batch.get(requests, 0) + 1
        self.max_requests_in_batch = max(self.max_requests_in_batch, requests)
        self.recent.append({"requests": requests, "sequences": sequences, "seconds": round(seconds, 4)})

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "requests": self.requests,
            "sequences": self.sequences,
            "mean_requests_per_batch": round(self.requests / self.batches, 3) if self.batches else 0.0,
            "max_requests_in_batch": self.max_requests_in_batch,
            "requests_per_batch": {str(k): v for k, v in sorted(self.requests_per_batch.items())},
            "busy_seconds": round(self.busy_seconds, 3),
            "recent_batches": list(self.recent),
        }


class BatchScheduler:
    def __init__(self, generate: GenerateFn, *, window_s: float = 0.01, max_batch_size: int = 32) -> None:
        self._generate = generate
        self.window_s = window_s
        self.max_batch_size = max_batch_size
        self.stats = BatchStats()
        self._pending: deque[_Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self._ids = itertools.count()
        self.running = 0  # requests in the batch being generated now

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not counting those whose client has gone)."""
        return sum(1 for job in self._pending if not job.future.done())

    async def submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapter: Path | None,
        on_token: OnToken | None = None,
        grammar: str | None = None,
    ) -> list[Choice]:
        """One Choice per prompt, in order, once the batch holding them has run; `on_token` sees
        each token before that (see the module doc)."""
        if not 1 <= len(prompts) <= self.max_batch_size:
            raise ValueError(f"a request must have 1 to {self.max_batch_size} sequences")
        loop = asyncio.get_running_loop()
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        key = self._key(sampling, adapter)
        job = _Job(prompts, sampling, adapter, key, loop.create_future(), on_token, grammar)
        self._pending.append(job)
        self._wakeup.set()
        return await job.future

    def _key(self, sampling: SamplingParams, adapter: Path | None) -> Hashable:
        greedy = sampling.temperature == 0
        return (
            str(adapter) if adapter else None,
            sampling.temperature,
            1.0 if greedy else sampling.top_p,
            sampling.max_new_tokens,
            tuple(sampling.stop),
            # A seeded request batches with nothing else (see the module doc).
            (sampling.seed, next(self._ids)) if sampling.seed is not None else None,
        )

    async def run(self) -> None:
        """The scheduling loop; run it as a task for the server's lifetime."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        try:
            while True:
                if not self._pending:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    await asyncio.sleep(self.window_s)  # let concurrent requests join
                await self._run_batch(self._take_batch())
        finally:
            for job in self._pending:
                if not job.future.done():
                    job.future.set_exception(RuntimeError("the server is shutting down"))
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _take_batch(self) -> list[_Job]:
        """The oldest request and every queued request compatible with it, oldest first."""
        key = self._pending[0].key
        batch: list[_Job] = []
        rest: deque[_Job] = deque()
        sequences = 0
        for job in self._pending:
            if job.future.done():  # the client went away before it ran
                continue
            if job.key == key and sequences + len(job.prompts) <= self.max_batch_size:
                batch.append(job)
                sequences += len(job.prompts)
            else:
                rest.append(job)
        self._pending = rest
        return batch

    async def _run_batch(self, batch: list[_Job]) -> None:
        if not batch:
            return
        prompts = [prompt for job in batch for prompt in job.prompts]
        loop = asyncio.get_running_loop()
        sampling = replace(batch[0].sampling, top_logprobs=max(job.sampling.top_logprobs for job in batch))
        on_token = self._token_router(batch, loop) if any(job.on_token for job in batch) else None
        grammars: list[str | None] | None = [job.grammar for job in batch for _ in job.prompts]
        if not any(grammar is not None for grammar in grammars or []):
            grammars = None
        started = time.perf_counter()
        self.running = len(batch)
        try:
            choices = await loop.run_in_executor(
                self._executor, self._generate, prompts, sampling, batch[0].adapter, on_token, grammars
            )
        except Exception as exc:
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finally:
            self.running = 0
            self.stats.record(len(batch), len(prompts), time.perf_counter() - started)
            metrics.BATCH_SIZE.observe(len(prompts))
        offset = 0
        for job in batch:
            if not job.future.done():
                job.future.set_result(choices[offset : offset + len(job.prompts)])
            offset += len(job.prompts)

    @staticmethod
    def _token_router(batch: list[_Job], loop: asyncio.AbstractEventLoop) -> OnToken:
        """An on_token for the generation thread that hands each token to its request's callback
        on the event loop. Tokens are queued on the loop before the batch's result is, so a
        request sees all of its tokens before its future resolves."""
        owners = [(job, index) for job in batch for index in range(len(job.prompts))]

        def route(delta: TokenDelta) -> None:
            job, index = owners[delta.index]
            if job.on_token is not None and not job.future.done():  # done: the client went away
                loop.call_soon_threadsafe(job.on_token, replace(delta, index=index))

        return route
