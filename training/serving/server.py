"""Run an InferenceApp under uvicorn and keep its registration fresh.

The socket is bound here, before uvicorn starts, so port 0 works and the advertised URL names the
real port. A daemon thread calls `heartbeat(url, app)` every `heartbeat_interval_s` once the
server accepts connections (never on the event loop: the callback may block on a database), and
`on_stop(url)` runs when the server exits so routing stops at once on a clean shutdown.

Invariant (training.serving.binding): a server that requires no token listens on loopback only.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from training.serving.app import InferenceApp
from training.serving.binding import InsecureBindError, is_loopback

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio disables Nagle (TCP_NODELAY) only on sockets that say they
    # are TCP, and accepted sockets inherit this. With proto 0, a response's header and body writes
    # wait on delayed ACKs: ~40 ms per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def advertised_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()  # a wildcard address cannot be dialled from another host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def serve(
    app: InferenceApp,
    *,
    sock: socket.socket,
    url: str,
    heartbeat: Callable[[str, InferenceApp], None] | None = None,
    heartbeat_interval_s: float = 2.0,
    on_stop: Callable[[str], None] | None = None,
    log_level: str = "warning",
    token: str,
) -> None:
    """Serve until SIGINT/SIGTERM. ``token`` is the one ``app`` requires ("" = none): an app that
    requires none is served only on a loopback socket (InsecureBindError otherwise), whatever its
    caller checked."""
    import uvicorn

    if not token and not is_loopback(str(sock.getsockname()[0])):
        raise InsecureBindError(f"refusing to serve without a token on {sock.getsockname()[0]}")

    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=75,  # longer than the gateway's pooled-connection idle time
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set() and not server.started:
            stop.wait(0.05)
        while not stop.is_set():
            if heartbeat is not None:
                try:
                    heartbeat(url, app)
                except Exception:  # a database hiccup must not kill the server; the next beat retries
                    log.exception("heartbeat failed")
            stop.wait(heartbeat_interval_s)

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    # uvicorn shuts down gracefully on SIGTERM and then raises the signal again under the handler
    # that was there before it; the default one would end the process before `on_stop` runs.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run(sockets=[sock])
    finally:
        stop.set()
        thread.join(timeout=5)
        if on_stop is not None:
            try:
                on_stop(url)
            except Exception:
                log.exception("deregistration failed")


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)
