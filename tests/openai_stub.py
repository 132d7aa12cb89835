"""A tiny OpenAI-compatible chat-completions server for tests: a thread on 127.0.0.1 that answers
each request with the next scripted reply and records what it was sent. No network beyond loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from training.safety.outbound import OutboundPolicy

# The test servers listen on loopback, which the outbound policy refuses unless allow-listed; tests
# that build endpoints themselves pass this policy (tests/conftest.py sets the same for projects/).
LOOPBACK_ALLOWED = ("127.0.0.1", "::1", "localhost")
LOOPBACK = OutboundPolicy(allow=LOOPBACK_ALLOWED)

# A scripted reply: assistant text, a full message dict ({"content", "tool_calls"}), an HTTP status
# (an error), or a function of the request body returning one of those.
Reply = str | dict[str, Any] | int | Callable[[dict[str, Any]], Any]


@dataclass
class StubServer:
    replies: list[Reply]
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_reply(self, body: dict[str, Any]) -> Any:
        with self.lock:
            self.requests.append(body)
            reply = self.replies.pop(0) if self.replies else "no more scripted replies"
        return reply(body) if callable(reply) else reply


def completion(message: dict[str, Any], model: str) -> dict[str, Any]:
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str = "call_0") -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


@contextmanager
def openai_stub(replies: list[Reply]) -> Iterator[StubServer]:
    stub = StubServer(list(replies))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            stub.headers.append(dict(self.headers))
            reply = stub.next_reply(body)
            if isinstance(reply, int):
                payload = json.dumps({"error": {"message": "scripted failure"}}).encode()
                self.send_response(reply)
            else:
                message = {"content": reply} if isinstance(reply, str) else reply
                payload = json.dumps(completion(message, body.get("model", ""))).encode()
                self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stub.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
