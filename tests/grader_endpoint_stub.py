"""A team's grader endpoint for the endpoint-grader tests (`training.rewards.endpoint`): a real HTTP
server on 127.0.0.1 in a thread that records every request and answers from a script."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# An answer: a JSON value (sent with 200), or (status, raw body text), or ("hang", seconds).
Answer = Any


@dataclass
class GraderEndpoint:
    url: str
    # answer(request body) -> an Answer; `script` answers first, one entry per request, in order
    answer: Callable[[dict[str, Any]], Answer] = lambda body: {"reward": 1.0}
    script: list[Answer] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_answer(self, body: dict[str, Any]) -> Answer:
        with self.lock:
            self.requests.append(body)
            if self.script:
                return self.script.pop(0)
        return self.answer(body)


@contextmanager
def grader_endpoint(path: str = "/grade") -> Iterator[GraderEndpoint]:
    holder: dict[str, GraderEndpoint] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            endpoint = holder["endpoint"]
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with endpoint.lock:
                endpoint.headers.append(dict(self.headers))
            answer = endpoint.next_answer(body) if self.path == path else (404, "not found")
            if isinstance(answer, tuple) and answer[0] == "hang":
                time.sleep(answer[1])
                answer = {"reward": 1.0}
            status, text = answer if isinstance(answer, tuple) else (200, json.dumps(answer))
            data = text.encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (the timeout test)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    holder["endpoint"] = GraderEndpoint(url=f"http://127.0.0.1:{httpd.server_address[1]}{path}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder["endpoint"]
    finally:
        httpd.shutdown()
        httpd.server_close()
