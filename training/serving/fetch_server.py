"""A vLLM host's checkpoint fetcher: the one thing vLLM cannot do for itself.

vLLM loads a LoRA adapter from a folder on its own disk (``/v1/load_lora_adapter``'s
``lora_path``). On a host that did not write the checkpoint, the gateway first asks this server,
which ``serve_inference --engine vllm`` runs beside vLLM, to fetch the checkpoint by store key and
digest into the host's verified cache (training.serving.fetch_cache, under its disk budget), and
then hands vLLM the local folder it answered.

    POST /v1/fetch_checkpoint  {"key": "model-3/step-000002", "sha256": "<64 hex>"}
    200 {"path": "/data/inference-cache/model-3/step-000002"}
    404 the store has no such checkpoint; 502 it could not be fetched (digest, store unreachable)
    GET /metrics  the cache's Prometheus series (training.serving.metrics)

Every request, on every path and method, needs ``Authorization: Bearer <server token>`` (the gateway
holds it); there is no open route. Without a token it listens on loopback only (``start_fetch_server``
refuses another host). Plain ``http.server``: one small route, threads for slow downloads.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from training.serving import metrics
from training.serving.binding import InsecureBindError, is_loopback
from training.serving.fetch_cache import FetchedCheckpoints
from training.serving.protocol import FETCH_PATH
from training.wire.openai_errors import error_object

# Every (method, path) it answers (tests walk them: none answers without the token).
ROUTES = (("POST", FETCH_PATH), ("GET", "/metrics"))

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_BODY = 4096


def start_fetch_server(cache: FetchedCheckpoints, *, host: str, port: int, token: str) -> ThreadingHTTPServer:
    """Serve ``FETCH_PATH`` on ``host:port`` (0: a free port) in a daemon thread; returns the server
    (``server.server_address[1]`` is the port; ``shutdown()`` stops it). InsecureBindError: no
    token on a host other than loopback."""
    if not token and not is_loopback(host):
        raise InsecureBindError(f"the checkpoint fetcher needs a token to listen on {host!r}")

    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not token or hmac.compare_digest(given.encode(), token.encode()):  # no token: loopback
                return True
            self._reply(401, error_object(401, "A valid server token is required.", code="invalid_api_key"))
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            """``/metrics``: the cache's Prometheus series (budget, bytes, hits, misses, evictions)."""
            if not self._authorized():
                return
            if self.path != "/metrics":
                return self._reply(404, error_object(404, f"Unknown path {self.path}", code="not_found"))
            data, content_type = metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if not self._authorized():
                return
            if self.path != FETCH_PATH:
                return self._reply(404, error_object(404, f"Unknown path {self.path}", code="not_found"))
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                return self._reply(413, error_object(413, "The body is too large.", code="body_too_large"))
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                key, sha256 = body["key"], body["sha256"]
                if not (isinstance(key, str) and isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                return self._reply(400, error_object(400, 'Send {"key": "...", "sha256": "<64 hex>"}.',
                                                     code="invalid_request"))  # fmt: skip
            try:
                path = cache.get(key, sha256)
            except FileNotFoundError:
                return self._reply(
                    404, error_object(404, f"No stored checkpoint {key!r}.", code="model_not_found")
                )
            except Exception as exc:  # a digest that does not match, a bad key, an unreachable store
                log.exception("cannot fetch checkpoint %s", key)
                return self._reply(502, error_object(502, f"Cannot fetch the checkpoint: {exc}",
                                                     code="adapter_fetch_failed"))  # fmt: skip
            self._reply(200, {"path": str(path)})

        def _other_method(self) -> None:
            if self._authorized():
                self._reply(405, error_object(405, f"{self.command} is not allowed on {self.path}"))

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _other_method  # noqa: N815 (http.server's names)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            log.debug("fetch server: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="checkpoint-fetch", daemon=True).start()
    return server
