"""A team's JSON endpoint on 127.0.0.1 for the benchmarks that call one (an endpoint grader, Agent
RFT tools): each POST's decoded body goes to ``answer(path, body)``, whose object is the JSON reply.

The server listens with a backlog of 128, not http.server's 5: a step's calls arrive at once, and
with 5 the kernel drops SYNs and retransmits them after 1 s — the stub's limit, not the code's
(benchmarks/endpoint_grader.py measured ~1 s a step before this)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LoopbackServer(ThreadingHTTPServer):
    request_queue_size = 128
    daemon_threads = True

    @property
    def host(self) -> str:
        """``127.0.0.1:<port>``, as OUTBOUND_ALLOW takes it."""
        return f"127.0.0.1:{self.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.host}"


def json_endpoint(answer: Callable[[str, Any], Any], *, latency_s: float = 0.0) -> LoopbackServer:
    """A started server answering every POST with ``answer(path, body)`` after ``latency_s`` (the
    team's code doing its work); ``shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            time.sleep(latency_s)
            data = json.dumps(answer(self.path, body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = LoopbackServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
