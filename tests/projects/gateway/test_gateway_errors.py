"""The gateway (/v1/, served by the bare ASGI handler) answers every error as an OpenAI error object
with an X-Request-Id: bodies the strict JSON reader refuses, a body over the upload limit (413),
an unhandled exception (500), an unknown path (404)."""

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


def call(method: str, path: str, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None):
    from projects.gateway.asgi import application

    all_headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), *(headers or [])]  # fmt: skip
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": all_headers, "client": ("127.0.0.1", 1), "server": ("testserver", 80)}  # fmt: skip
    sent: list[dict] = []
    requests = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    asyncio.run(application(scope, receive, send))
    start = sent[0]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, content


def error_of(status: int, headers: dict, content: bytes) -> dict:
    assert headers["content-type"].startswith("application/json"), content[:200]
    assert headers["x-request-id"].startswith("req_")
    error = json.loads(content)["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == headers["x-request-id"]  # a report quoting the body finds the logs
    return error


def chat(alpha_key: str, text: str):
    return call(
        "POST", "/v1/chat/completions", text.encode(), [(b"authorization", f"Bearer {alpha_key}".encode())]
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            '{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "nested deeper than 64 levels",
        ),
        ('{"model": "tiny", "messages": [], "temperature": NaN}', "NaN is not a JSON number"),
        ('{"model": "tiny", "messages": [], "max_tokens": ' + "9" * 4301 + "}", "integer out of range"),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "lone UTF-16 surrogate"),
    ],
)
def test_a_body_the_strict_reader_refuses_is_a_400_naming_the_position(alpha_key, text, reason):
    status, headers, content = chat(alpha_key, text)
    error = error_of(status, headers, content)
    assert status == 400 and error["code"] == "invalid_json", error
    assert reason in error["message"] and "line 1 column" in error["message"]


def test_a_body_over_the_upload_limit_is_a_413_error_object(alpha_key, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 2048
    status, headers, content = chat(
        alpha_key, '{"model": "tiny", "messages": [], "user": "' + "x" * 4096 + '"}'
    )
    assert status == 413 and error_of(status, headers, content)["code"] == "body_too_large"


def test_an_unhandled_exception_is_a_500_error_object_naming_the_request_id(alpha_key, monkeypatch):
    from projects.gateway import views

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(views, "_prepare_remembered", broken)
    status, headers, content = chat(alpha_key, '{"model": "tiny", "messages": []}')
    error = error_of(status, headers, content)
    assert status == 500 and error["type"] == "api_error" and error["code"] == "server_error"
    assert headers["x-request-id"] in error["message"] and "a bug" not in error["message"]


def test_an_unknown_gateway_path_is_a_json_404():
    status, headers, content = call("GET", "/v1/no-such-endpoint")
    assert status == 404 and error_of(status, headers, content)["code"] == "not_found"
