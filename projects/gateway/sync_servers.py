"""The gateway under a WSGI server (``manage.py runserver``, gunicorn's sync workers).

Under WSGI Django runs an async view through ``async_to_sync``, on an event loop made for that one
call and closed when the view returns, and reads an async streamed body on yet another such loop.
An upstream connection (asyncio streams, projects.gateway.http) belongs to the loop that opened it,
so a streamed completion failed with "Event loop is closed", and the usage writes scheduled after a
response were cancelled with their loop. So under WSGI the gateway's work runs on one long-lived
loop of its own (a daemon thread): the view waits for it, and a streamed body becomes a plain
iterator that takes each chunk from that loop as it arrives (WSGI then streams chunk by chunk,
where Django would buffer an async body whole). Under ASGI nothing changes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, StreamingHttpResponse
from django.http.response import HttpResponseBase

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()
_END = object()


def _gateway_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="gateway-loop", daemon=True).start()
            _loop = loop
        return _loop


async def serve(request: HttpRequest, work: Coroutine[Any, Any, HttpResponseBase]) -> HttpResponseBase:
    """``work``'s response: awaited here under ASGI, run on the gateway's own loop under WSGI."""
    if isinstance(request, ASGIRequest):
        return await work
    loop = _gateway_loop()
    response = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, loop))
    if isinstance(response, StreamingHttpResponse) and response.is_async:
        content = response.streaming_content
        assert isinstance(content, AsyncIterator)  # is_async: an async generator over the chunks
        response.streaming_content = _pulled(content, loop)
    return response


def _pulled(chunks: AsyncIterator[bytes], loop: asyncio.AbstractEventLoop) -> Iterator[bytes]:
    """A plain iterator over ``chunks``, each taken on ``loop``; closing it (the client left) closes
    the async one there, which gives the upstream connection back or closes it."""

    async def next_chunk() -> Any:
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return _END

    try:
        while (chunk := asyncio.run_coroutine_threadsafe(next_chunk(), loop).result()) is not _END:
            yield chunk
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=30)
