"""The inference server's errors are OpenAI error objects too: a body the strict JSON reader
refuses is a 400 naming the position, and an unforeseen exception a 500 (the gateway relays both)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from training.serving.app import InferenceApp, ServerConfig


def post(
    app: InferenceApp, data: bytes, *, generate: bool = False, path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """One POST (``path``) to ``app``; ``generate`` runs the scheduler too (a request that gets past
    parsing waits on it forever otherwise)."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": data, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": raw_headers}

    async def request() -> None:
        scheduler = asyncio.create_task(app.scheduler.run()) if generate else None
        try:
            await app(scope, receive, send)
        finally:
            if scheduler is not None:
                scheduler.cancel()

    asyncio.run(request())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


@pytest.fixture
def app(engine, tmp_path) -> InferenceApp:
    return InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path))


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than 64"),
        ('{"model": "tiny", "messages": [], "temperature": Infinity}', "Infinity is not a JSON number"),
        ('{"model": "tiny", "messages": [], "n": ' + "1" * 4301 + "}", "integer out of range"),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone UTF-16 surrogate"),
    ],
)
def test_a_body_the_strict_reader_refuses_is_a_400(app, text, reason):
    status, body = post(app, text.encode())
    assert status == 400 and body["error"]["code"] == "invalid_json"
    assert reason in body["error"]["message"] and "line 1 column" in body["error"]["message"]


# Past int()'s 4,300-digit limit, past the recursion limit: json.loads raises, and not JSONDecodeError.
@pytest.mark.parametrize("arguments", ["1" * 5000, "[" * 5000])
def test_an_assistant_tool_call_the_json_reader_cannot_hold_is_not_a_500(app, arguments):
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}  # fmt: skip
    status, reply = post(app, json.dumps(body).encode(), generate=True)
    assert status == 200, reply  # the arguments reach the template as the text they are, like any bad JSON


def test_an_unforeseen_exception_is_a_500_error_object(app, monkeypatch):
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(app, "_chat", broken)
    status, body = post(app, b"{}")
    assert status == 500 and body["error"]["type"] == "api_error" and "a bug" not in body["error"]["message"]
