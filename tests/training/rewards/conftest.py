"""A small OpenAI-compatible judge for the judge-grader tests: a real HTTP server on 127.0.0.1 in a
thread, answering each chat completion with whatever the test's `reply` function returns."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.openai_stub import LOOPBACK
from training.rewards import JudgeClient


def completion(
    content: str | None,
    *,
    refusal: str | None = None,
    model: str = "judge-1",
    prompt_tokens: int = 10,
    completion_tokens: int = 2,
    finish_reason: str = "stop",
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


@dataclass
class JudgeServer:
    url: str
    # reply(request body) -> a completion dict, or (status, raw body text[, headers]) for a failure
    reply: Callable[[dict[str, Any]], Any] = lambda body: completion("1")
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, **overrides: Any) -> JudgeClient:
        settings = {
            "base_url": self.url,
            "api_key": "sk-test-key",
            "timeout": 5.0,
            "retries": 0,
            "outbound": LOOPBACK,
            **overrides,
        }
        return JudgeClient(**settings)

    @staticmethod
    def user_text(body: dict[str, Any]) -> str:
        return "\n".join(m["content"] for m in body["messages"] if m["role"] == "user")


@pytest.fixture(scope="session")
def _judge_http_server() -> Iterator[dict[str, JudgeServer]]:
    holder: dict[str, JudgeServer] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            server = holder["server"]
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with server.lock:
                server.requests.append(body)
                server.headers.append(dict(self.headers))
            if self.path != "/v1/chat/completions":
                answer: Any = (404, "not found")
            else:
                answer = server.reply(body)
            status, text, *extra = answer if isinstance(answer, tuple) else (200, json.dumps(answer))
            data = text.encode()
            try:
                self.send_response(status)
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (the timeout test)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder["server"] = JudgeServer(url=f"http://127.0.0.1:{httpd.server_address[1]}/v1")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def judge_server(_judge_http_server: dict[str, JudgeServer]) -> JudgeServer:
    """The session's server with a fresh script and request log for this test."""
    _judge_http_server["server"] = JudgeServer(url=_judge_http_server["server"].url)
    return _judge_http_server["server"]
