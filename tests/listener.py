"""A local HTTP listener for the outbound-policy tests: it counts every TCP connection it accepts
(so a test can prove a refused call never connected), records each request's Host header and
path, and answers with a scripted (status, body), by default a one-word chat completion."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def chat_completion(content: str) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-listener",
            "object": "chat.completion",
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


@dataclass
class Listener:
    port: int = 0
    status: int = 200
    body: str = field(default_factory=lambda: chat_completion("1"))
    connections: int = 0
    hosts: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def listening(family: int = socket.AF_INET) -> Iterator[Listener]:
    listener = Listener()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            self.rfile.read(length)
            listener.hosts.append(self.headers.get("Host", ""))
            listener.paths.append(self.path)
            data = listener.body.encode()
            self.send_response(listener.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer  # noqa: N815 - http.server's names

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        address_family = family

        def verify_request(self, request: Any, client_address: Any) -> bool:
            listener.connections += 1
            return True

    server = Server(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0), Handler)
    listener.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        server.shutdown()
        server.server_close()


class FakeDNS:
    """``socket.getaddrinfo`` for made-up names (``*.test``): each lookup of a name takes its next
    scripted answer (the last one repeats), so a test can make a name rebind between a check and a
    connection. Other names go to the real resolver. Install with ``monkeypatch``."""

    def __init__(self, monkeypatch: Any) -> None:
        self.answers: dict[str, list[list[str]]] = {}
        self.lookups: dict[str, int] = {}
        self._real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self.getaddrinfo)

    def add(self, name: str, *answers: str | list[str]) -> None:
        self.answers[name] = [[answer] if isinstance(answer, str) else list(answer) for answer in answers]

    def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name not in self.answers:
            return self._real(host, port, *args, **kwargs)
        count = self.lookups.get(name, 0)
        self.lookups[name] = count + 1
        scripted = self.answers[name]
        addresses = scripted[min(count, len(scripted) - 1)]
        port_number = int(port or 0)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port_number, 0, 0))
            if ":" in ip
            else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port_number))
            for ip in addresses
        ]
