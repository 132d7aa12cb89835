"""Request ids, and JSON for every error on ``/api/`` and ``/v1/``.

Every request gets an id (``req_<hex>``), returned as ``X-Request-Id`` and written in the log line
of a failure. On the REST API and the gateway every error is OpenAI's error object (the one table,
training.wire.openai_errors), even one nothing else handled: a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE``
is a 413, another refused request (too many fields, a bad Host) a 400, and any other exception a
500 naming the request id (the traceback goes to the log, never to the client). Dashboard pages
keep Django's HTML error pages.

Two places catch what escapes a view, because Django reaches them by different routes:
``RequestIdMiddleware.process_exception`` (a view raised; in DEBUG too) and the URLconf's
``handler400/403/404/500`` (raised outside a view, e.g. by another middleware or the URL resolver).
The middleware is async-capable, so the gateway's bare ASGI handler (projects.gateway.asgi) runs it
without a thread hop.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import logging
import re
import uuid
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core import signals
from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.urls import Resolver404, get_resolver, resolve
from django.views import defaults

from projects.logs import log_context
from training.rollouts import strict_json
from training.wire.openai_errors import error_object

logger = logging.getLogger("artweb.errors")

JSON_PREFIXES = ("/api/", "/v1/", "/tinker/")
HEADER = "X-Request-Id"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def request_id_of(request: HttpRequest) -> str:
    request_id = getattr(request, "request_id", None)
    if request_id is None:  # a request that never passed the middleware (a handler's own)
        request_id = request.request_id = new_request_id()  # type: ignore[attr-defined]
    return request_id


def wants_json(request: HttpRequest) -> bool:
    return request.path.startswith(JSON_PREFIXES)


def json_error(request: HttpRequest, status: int, message: str, *, code: str | None = None) -> JsonResponse:
    response = JsonResponse(error_object(status, message, code=code), status=status)
    response[HEADER] = request_id_of(request)
    return response


def with_request_id(response: Any, request_id: str) -> Any:
    """An OpenAI error object (``{"error": {...}}``, any status >= 400) also names the request id
    (``error.request_id``), so a report quoting the body finds the log lines. Other responses, and
    streams, pass unchanged."""
    if response.status_code < 400 or getattr(response, "streaming", False):
        return response
    if not response.get("Content-Type", "").startswith("application/json"):
        return response
    try:
        body = json.loads(response.content)
    except ValueError:
        return response
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "request_id" not in error:
        error["request_id"] = request_id
        response.content = json.dumps(body).encode()
        if response.has_header("Content-Length"):  # set by CommonMiddleware for the old body
            response["Content-Length"] = str(len(response.content))
    return response


def exception_response(request: HttpRequest, exc: BaseException) -> JsonResponse:
    """The error object for an exception nothing else turned into a response."""
    if isinstance(exc, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return json_error(request, 413, f"The request body is larger than the limit of {limit} bytes.")
    if isinstance(exc, SuspiciousOperation):
        return json_error(request, 400, f"The request was refused ({type(exc).__name__}).")
    if isinstance(exc, Http404):
        return json_error(request, 404, "Not found.")
    if isinstance(exc, PermissionDenied):
        return json_error(request, 403, "You do not have permission to perform this action.")
    request_id = request_id_of(request)
    return json_error(
        request,
        500,
        "The server had an error while processing your request. "
        f"Quote request id {request_id} if you report it.",
    )


def names_nothing(request: HttpRequest) -> bool:
    """Whether an API path holds what no id holds and PostgreSQL cannot even compare (NUL; a lone
    surrogate, which an ASGI server that decodes percent-escapes loosely can pass on): a 404 before
    any view looks it up (issue 51)."""
    return wants_json(request) and not strict_json.storable(request.path_info)


def _nothing_found(request: HttpRequest) -> JsonResponse:
    return json_error(request, 404, "Not found: the path holds a NUL or a lone surrogate, which no id holds.")


class RequestIdMiddleware:
    """First in MIDDLEWARE (and the gateway's one middleware): the id, and JSON for what a view raised."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        request.request_id = new_request_id()  # type: ignore[attr-defined]
        with log_context(request_id=request.request_id):  # type: ignore[attr-defined]
            if names_nothing(request):
                return self._finish(request, _nothing_found(request))
            return self._finish(request, self.get_response(request))

    async def __acall__(self, request: HttpRequest) -> Any:
        request.request_id = new_request_id()  # type: ignore[attr-defined]
        with log_context(request_id=request.request_id):  # type: ignore[attr-defined]
            if names_nothing(request):
                return self._finish(request, _nothing_found(request))
            return self._finish(request, await self.get_response(request))

    def _finish(self, request: HttpRequest, response: Any) -> Any:
        # Under DEBUG Django answers a URL that resolves nowhere with its HTML page, not handler404.
        html = response.get("Content-Type", "").startswith("text/html")
        if response.status_code == 404 and html and wants_json(request):
            response = json_error(request, 404, not_found_message(request.path))
        response[HEADER] = request.request_id  # type: ignore[attr-defined]
        return with_request_id(response, request.request_id)  # type: ignore[attr-defined]

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not wants_json(request):
            return None  # the dashboard: Django's own handling and HTML pages
        expected = isinstance(exception, SuspiciousOperation | Http404 | PermissionDenied)
        if not expected:
            logger.error(
                "Unhandled exception on %s %s (request id %s)",
                request.method,
                request.path,
                request_id_of(request),
                exc_info=exception,
            )
            # What Django sends for an unhandled exception: error reporters, and the test
            # client (which re-raises it in tests unless told not to).
            signals.got_request_exception.send(sender=None, request=request)
        return exception_response(request, exception)


def not_found_message(path: str) -> str:
    """The 404 message, naming the path that exists when this one is a near miss."""
    suggestion = near_miss(path)
    if suggestion is None:
        return f"No endpoint at {path}."
    return f"No endpoint at {path}; did you mean {suggestion}?"


def near_miss(path: str) -> str | None:
    """An existing API path close to ``path``: unknown or misspelt words replaced by the closest
    words the URLconf uses (``/api/v1/run/3/event`` -> ``/api/v1/runs/3/events``), else the slash
    toggled; the fewest changes win."""
    prefix = next((p for p in JSON_PREFIXES if path.startswith(p)), None)
    if prefix is None:
        return None
    words, segments = _url_words(), path.strip("/").split("/")
    options = [
        [segment]
        if not segment or segment.isdigit()
        else [
            segment,
            *(w for w in difflib.get_close_matches(segment, words, n=3, cutoff=0.6) if w != segment),
        ]
        for segment in segments
    ]
    tried = itertools.islice(itertools.product(*options), 200)
    endings = ("/", "") if path.endswith("/") else ("", "/")
    ranked = sorted(tried, key=lambda choice: sum(a != b for a, b in zip(choice, segments, strict=True)))
    for choice in ranked:
        for ending in endings:
            candidate = "/" + "/".join(choice) + ending
            if candidate == path or not candidate.startswith(prefix):
                continue
            try:
                resolve(candidate)
            except Resolver404:
                continue
            return candidate
    return None


@functools.cache
def _url_words() -> frozenset[str]:
    """The literal words of every URL pattern (``runs``, ``events``, ``hyperparameters``, …)."""
    found: set[str] = set()

    def walk(patterns: list[Any]) -> None:
        for pattern in patterns:
            text = re.sub(r"\(\?P<[^>]+>[^)]*\)|<[^>]+>", "", str(pattern.pattern))
            found.update(re.findall(r"[a-z][a-z0-9_-]*", text))
            walk(getattr(pattern, "url_patterns", []))

    walk(get_resolver().url_patterns)
    return frozenset(found)


# --- the URLconf's handlers (artweb.urls): errors raised outside any view ---------------------------


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if wants_json(request):
        return exception_response(request, exception)
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    if wants_json(request):
        return json_error(request, 403, "You do not have permission to perform this action.")
    return defaults.permission_denied(request, exception)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if wants_json(request):
        return json_error(request, 404, not_found_message(request.path))
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if wants_json(request):  # Django has logged the exception already
        return exception_response(request, Exception())
    return defaults.server_error(request)
