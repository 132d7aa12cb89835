"""An ASGI entry point that serves the gateway (``/v1/…``) without Django's middleware and
everything else with the full stack. `artweb.asgi` (what uvicorn runs) re-exports it.

Why: under ASGI each of Django's classic middlewares (security, sessions, common, CSRF, auth,
messages, clickjacking) runs its hooks through ``sync_to_async``, and whitenoise is sync-only, so a
request crosses threads a dozen times before the view runs: measured at about 3 ms of the
gateway's added latency on a loaded 2-core machine (benchmarks/README.md). None of them does
anything for ``/v1/``: its views authenticate API keys themselves, are CSRF-exempt, use no
session, serve no static files and return JSON. What ``/v1/`` gives up is SecurityMiddleware's
headers and HTTPS redirect: terminate TLS (and set HSTS) in the proxy in front, as usual for an API.
It keeps one middleware, the async request-id one (projects.middleware), so a body over the upload
limit or an unhandled exception is still a JSON error object with an ``X-Request-Id``. In front of
both handlers, projects.body_limits refuses a body too large or without credentials unread.
"""

from __future__ import annotations

from typing import Any

from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response

from projects.middleware import RequestIdMiddleware

GATEWAY_PREFIX = "/v1/"


class BareASGIHandler(ASGIHandler):
    """Django's ASGI handler (URL routing, request objects, signals) with only RequestIdMiddleware."""

    def load_middleware(self, is_async: bool = False) -> None:
        # What BaseHandler.load_middleware builds for MIDDLEWARE = [RequestIdMiddleware].
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        get_response = self._get_response_async if is_async else self._get_response  # type: ignore[attr-defined]
        request_ids = RequestIdMiddleware(convert_exception_to_response(get_response))
        self._exception_middleware: list[Any] = [request_ids.process_exception]
        self._middleware_chain = convert_exception_to_response(request_ids)


django_application = get_asgi_application()  # sets Django up before the bare handler is built
gateway_application = BareASGIHandler()

from projects.body_limits import with_body_limits  # noqa: E402  (imports models: needs Django set up)


async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http" and scope["path"].startswith(GATEWAY_PREFIX):
        await gateway_application(scope, receive, send)
    else:
        await django_application(scope, receive, send)


# Both handlers spool a whole body before anything checks it: on /api/ and /v1/ the gate refuses
# one over the route's limit, or without credentials, before it is read (projects.body_limits).
application = with_body_limits(route)
