"""The lean ASGI entry point (projects.gateway.asgi): /v1/ without middleware, the rest as usual."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _close_gateway_connections():
    yield
    from projects.gateway.db import close_db_thread_connections

    close_db_thread_connections()  # the views ran on the gateway's database threads


def call(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, bytes]:
    from projects.gateway.asgi import application

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1),
             "server": ("testserver", 80)}  # fmt: skip
    sent: list[dict] = []
    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    asyncio.run(application(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body


def test_the_gateway_skips_the_middleware_and_everything_else_keeps_it(alpha_key):
    status, headers, body = call("/v1/models", [(b"authorization", f"Bearer {alpha_key}".encode())])
    assert status == 200 and json.loads(body)["object"] == "list"
    assert "x-frame-options" not in headers  # no clickjacking middleware on /v1/
    status, _, body = call("/v1/models", [(b"authorization", b"Bearer aw_nope_nope")])
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"

    status, headers, _ = call("/healthz", [])
    assert status == 200 and headers.get("x-frame-options") == "DENY"  # the full stack
