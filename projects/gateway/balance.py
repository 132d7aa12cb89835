"""Which of a base model's live inference servers a completion goes to, and in what order the
others are tried when it cannot be reached.

Order: a server that refused a connection in the last GATEWAY_SERVER_DOWN_S seconds last; then the
fewest requests in flight, counting GATEWAY_ADAPTER_LOAD_COST more for a server that does not hold
the checkpoint's adapter (a load costs about that many queued requests); ties broken by the
rendezvous order live_servers gives, so a checkpoint's first load lands on the same server
from every gateway process.

Invariant: counts are this process's own (each gateway process balances its share, as one nginx
worker's least_conn does); a request is counted from just before it is sent until its response
ends (the last streamed byte, the client leaving, or any error), through one idempotent release.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from django.conf import settings
from django.http import StreamingHttpResponse

from projects import metrics
from projects.models import InferenceServer
from projects.selectors.serving import Target

_lock = threading.Lock()  # the gateway may run async views in several threads (WSGI)
_outstanding: dict[str, int] = {}
_down_until: dict[str, float] = {}


def holds_adapter(server: InferenceServer, target: Target) -> bool:
    """Whether ``server`` reported (or, for vLLM, the gateway recorded) the target's adapter as
    loaded. A base model, or a checkpoint without files, needs no adapter: every server holds it."""
    checkpoint = target.checkpoint
    if checkpoint is None or not (checkpoint.storage_key or checkpoint.path):
        return True
    from projects.gateway.vllm import adapter_name  # vllm imports routing; imported late

    names = {name for name in server.loaded_adapters if isinstance(name, str)}
    return bool(names & {checkpoint.storage_key, checkpoint.path, adapter_name(checkpoint)} - {""})


def order(servers: list[InferenceServer], target: Target) -> list[InferenceServer]:
    """``servers`` (best first by rendezvous) in the order to try them for ``target``."""
    now = time.monotonic()
    cost = settings.GATEWAY_ADAPTER_LOAD_COST
    with _lock:
        keys = {
            server.url: (
                _down_until.get(server.url, 0.0) > now,
                _outstanding.get(server.url, 0) + (0 if holds_adapter(server, target) else cost),
                rank,
            )
            for rank, server in enumerate(servers)
        }
    return sorted(servers, key=lambda server: keys[server.url])


def begin(url: str) -> Callable[[], None]:
    """Count one request in flight to ``url``; the returned release may be called any number of
    times and counts it out once."""
    with _lock:
        _outstanding[url] = _outstanding.get(url, 0) + 1
    metrics.GATEWAY_OUTSTANDING.labels(url).inc()
    released = False

    def release() -> None:
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            left = _outstanding.get(url, 1) - 1
            if left > 0:
                _outstanding[url] = left
            else:
                _outstanding.pop(url, None)
        metrics.GATEWAY_OUTSTANDING.labels(url).dec()

    return release


async def released_at_end(chunks: AsyncIterator[bytes], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """A stream's chunks, with ``release`` called once it ends or is abandoned."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        release()


class CountedStream(StreamingHttpResponse):
    """A streamed completion that counts out of its server when the handler closes it: a stream
    the handler never starts (the client left first) runs no ``finally`` in its chunks."""

    def __init__(self, *args: Any, release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._release = release

    def close(self) -> None:
        try:
            self._release()
        finally:
            super().close()


def mark_down(url: str) -> None:
    """``url`` refused a connection: try it last until GATEWAY_SERVER_DOWN_S have passed (its
    heartbeat ends routing to it altogether once INFERENCE_HEARTBEAT_TIMEOUT_S have)."""
    with _lock:
        _down_until[url] = time.monotonic() + settings.GATEWAY_SERVER_DOWN_S


def outstanding(url: str) -> int:
    with _lock:
        return _outstanding.get(url, 0)


def reset() -> None:
    """Forget every count and mark (tests)."""
    with _lock:
        _outstanding.clear()
        _down_until.clear()
