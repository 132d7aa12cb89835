"""The bearer-token guard vLLM's server runs with (``--middleware
training.serving.vllm_guard.BearerTokenGuard``, added by training.serving.vllm.vllm_serve_command).

vLLM's own ``--api-key``/``VLLM_API_KEY`` guards only ``/v1/*``; its server also answers
``/invocations``, ``/tokenize``, ``/detokenize``, ``/metrics``, ``/pooling``, ``/classify``,
``/score``, ``/rerank``, ``/ping``, its docs and more, with no key. This ASGI middleware, outermost in
vLLM's app, refuses every HTTP request and websocket without ``Authorization: Bearer <token>``
except ``GET /health`` (liveness, which the launcher polls), whatever the path: a route a newer vLLM
adds is closed too.

It runs inside vLLM's process, which may have a virtualenv of its own: standard library only. vLLM
builds middleware with the app as its one argument, so the token is read from ``VLLM_API_KEY`` in
that process's environment (set by the launcher, never on the command line); with none, every
route but /health is refused.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Any

TOKEN_VARIABLE = "VLLM_API_KEY"
OPEN_ROUTE = ("GET", "/health")


class BearerTokenGuard:
    def __init__(self, app: Any, token: str | None = None) -> None:
        self.app = app
        self.token = os.environ.get(TOKEN_VARIABLE, "") if token is None else token

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        body = json.dumps(
            {
                "error": {
                    "message": "A valid server token is required.",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }  # fmt: skip
        ).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if scope["type"] == "http" and (scope.get("method"), scope.get("path")) == OPEN_ROUTE:
            return True
        if not self.token:
            return False
        for name, value in scope.get("headers") or []:
            if name.lower() == b"authorization":
                given = value.decode("latin-1").removeprefix("Bearer ").strip()
                return hmac.compare_digest(given.encode(), self.token.encode())
        return False
