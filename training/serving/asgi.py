"""Plain ASGI helpers shared by the inference server (training.serving.app) and the trainer service
(training.hosting.service): the request body with a size limit, JSON responses, stream events."""

from __future__ import annotations

import json
from typing import Any

from training.serving.protocol import RequestError


async def disconnected(receive: Any) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def read_body(receive: Any, max_bytes: int) -> bytes:
    """The whole request body; RequestError 413 past ``max_bytes``, 400 if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError("the client disconnected", code="client_disconnected", status=400)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise RequestError("the request body is too large", code="body_too_large", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def json_response(
    send: Any, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    payload = json.dumps(body, ensure_ascii=False).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(key.encode(), value.encode()) for key, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def event(send: Any, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})
