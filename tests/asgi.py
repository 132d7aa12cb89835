"""One request to artweb's ASGI entry point (``projects.gateway.asgi``: the body gate, the gateway's
/v1/ and Django's handler behind it) in this process, for tests that need what the Django test
client skips."""

from __future__ import annotations

import asyncio
import json
from typing import Any


def asgi_call(
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    *,
    key: str | None = None,
    query: str = "",
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one request; ``key`` as a bearer token. The
    client stays connected after its body, as a real one waiting for the answer does."""
    from projects.gateway.asgi import application

    all_headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), *(headers or [])]  # fmt: skip
    if key:
        all_headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode("utf-8", "surrogatepass"),
             "query_string": query.encode(), "root_path": "", "headers": all_headers,
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}  # fmt: skip
    sent: list[dict[str, Any]] = []
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop()
        await asyncio.Event().wait()
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(application(scope, receive, send))
    start = sent[0]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, content


def asgi_json(method: str, path: str, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None,
              *, key: str | None = None, query: str = "") -> tuple[int, Any]:  # fmt: skip
    """``asgi_call``'s status and JSON body (None when it has none)."""
    status, _, content = asgi_call(method, path, body, headers, key=key, query=query)
    return status, json.loads(content) if content else None
