"""Request bodies on ``/api/``, ``/v1/`` and ``/tinker/`` are refused before they are read (issue 22).

Django's ASGI handler writes a whole request body to a temporary file before any middleware or
view runs, so a limit or a key checked there comes after the spooling: a 200 MB body without a key
was written to disk to be answered 401. This wrapper, in front of both handlers
(projects.gateway.asgi), answers on those paths before the handler reads anything:

- a body without valid credentials: 401 before any of it is read. Valid: a live API key
  (``Authorization: Bearer``; on ``/tinker/`` also the SDK's ``X-API-Key: tml-<key>``) or, on
  ``/api/`` only, a signed-in session (the gateway has none);
- then a ``Content-Length`` over the route's limit: 413 at once; a body without one (chunked) is
  cut at the limit with a 413 (the handler sees a disconnect and answers nothing);
- a ``Content-Encoding`` the route's views do not decode: 415 unread (only ``/tinker/`` decodes
  zstd, bounded by the same limit once decompressed: projects.content_encoding).

A request without a body passes untouched (nothing to spool; the views authenticate as before), so
anonymous routes (the schema, the docs) and every 404 answer as they did. A refusal says
``Connection: close``: without it uvicorn would read (and drop) the rest of the body to reuse the
connection. The dashboard's paths keep Django's own handling and its DATA_UPLOAD_MAX_MEMORY_SIZE.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from django.conf import settings
from django.contrib import auth
from django.http.cookie import parse_cookie
from django.utils.crypto import constant_time_compare
from rest_framework.exceptions import NotAuthenticated

from projects import services
from projects.content_encoding import ZSTD, UnsupportedEncoding, encoding_of
from projects.gateway import lookups
from projects.gateway.db import in_db_thread
from projects.middleware import HEADER as REQUEST_ID_HEADER
from projects.middleware import new_request_id
from projects.models import ApiKey
from projects.tinker.views import KEY_PREFIX as TINKER_KEY_PREFIX
from training.wire.openai_errors import error_object

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_PREFIX = "/api/"
GATEWAY_PREFIX = "/v1/"
PREVIEW_PREFIX = "/v1/preview/"
FINE_TUNING_PREFIX = "/v1/fine_tuning/"  # OpenAI's fine-tuning API: DRF views (projects.api.fine_tuning)
FILES_UPLOAD = re.compile(r"^/v1/files/?$")  # POST: a multipart fine-tuning `file`, a task set
TINKER_PREFIX = "/tinker/"  # the Tinker SDK's API (projects.tinker): its own key header and 401s
TASK_SET_UPLOAD = re.compile(r"^/api/v1/task-sets/?$")  # POST: a multipart `file` (projects.api.views)
# A task-set upload is its file (bounded by MAX_TASKSET_BYTES in the view) plus the multipart
# boundaries and a few short fields (project, name, validation_fraction, seed).
MULTIPART_OVERHEAD_BYTES = 1024 * 1024
# Where the gate left the API key it looked up, so DRF's authentication does not look it up again
# (projects.api.authentication). Only server code writes a scope; a client cannot set this.
VERIFIED_KEY = "artweb.verified_api_key"
DISCONNECT: Message = {"type": "http.disconnect"}

# The 401s the views answer today for the same request without a body, so a client cannot tell
# which layer refused it (tests compare them): DRF's on /api/ and /v1/preview/
# (projects.api.authentication), the gateway's on the rest of /v1/ (projects.gateway.views).
API_MISSING = (str(NotAuthenticated.default_detail), str(NotAuthenticated.default_code))
API_BAD_SCHEME = ("use 'Authorization: Bearer <api key>'", "authentication_failed")
API_BAD_KEY = ("invalid or revoked API key", "authentication_failed")
GATEWAY_MISSING = ("Missing API key: use 'Authorization: Bearer <team API key>'.", "missing_api_key")
GATEWAY_BAD_KEY = ("Incorrect API key provided, or the key was revoked.", "invalid_api_key")
# The Tinker views' own (projects.tinker.views._access), with the 401's default code.
TINKER_MISSING = ("send your key as X-API-Key: tml-<artweb API key>", error_object(401, "")["error"]["code"])
TINKER_BAD_KEY = (
    "invalid or revoked API key (the Tinker SDK takes tml- followed by an artweb key)",
    error_object(401, "")["error"]["code"],
)


@dataclass(frozen=True)
class Route:
    limit: int  # bytes
    setting: str  # the setting that sets the limit, named in the 413
    gateway: bool  # /v1/ outside /v1/preview/, /v1/files and /v1/fine_tuning/: the gateway's own 401s
    sessions: bool  # a signed-in session counts as credentials (/api/ only)
    tinker: bool = False  # /tinker/: the SDK's X-API-Key (tml-…) and the Tinker views' 401s
    encodings: tuple[str, ...] = ()  # the Content-Encodings its views decode (projects.content_encoding)


def route_of(path: str) -> Route | None:
    """The limits of ``path``, or None outside /api/ and /v1/. Read per request: tests and
    operators change the settings."""
    if path.startswith(TINKER_PREFIX):  # forward_backward batches: as large as ART's groups
        return Route(
            settings.PREVIEW_MAX_BODY_BYTES,
            "PREVIEW_MAX_BODY_BYTES",
            gateway=False,
            sessions=False,
            tinker=True,
            encodings=(ZSTD,),
        )
    if path.startswith(PREVIEW_PREFIX):  # OpenPipe ART's training jobs: many megabytes of groups
        return Route(settings.PREVIEW_MAX_BODY_BYTES, "PREVIEW_MAX_BODY_BYTES", gateway=False, sessions=False)
    if FILES_UPLOAD.match(path):
        limit = settings.MAX_TASKSET_BYTES + MULTIPART_OVERHEAD_BYTES
        return Route(limit, "MAX_TASKSET_BYTES", gateway=False, sessions=False)
    if path.startswith(FINE_TUNING_PREFIX) or path.startswith("/v1/files/"):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Route(limit, "DATA_UPLOAD_MAX_MEMORY_SIZE", gateway=False, sessions=False)
    if path.startswith(GATEWAY_PREFIX):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Route(limit, "DATA_UPLOAD_MAX_MEMORY_SIZE", gateway=True, sessions=False)
    if TASK_SET_UPLOAD.match(path):
        limit = settings.MAX_TASKSET_BYTES + MULTIPART_OVERHEAD_BYTES
        return Route(limit, "MAX_TASKSET_BYTES", gateway=False, sessions=True)
    if path.startswith(API_PREFIX):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Route(limit, "DATA_UPLOAD_MAX_MEMORY_SIZE", gateway=False, sessions=True)
    return None


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    code: str
    headers: tuple[tuple[bytes, bytes], ...] = ()

    async def send(self, send: Send) -> None:
        request_id = new_request_id()
        body = error_object(self.status, self.message, code=self.code)
        body["error"]["request_id"] = request_id  # as RequestIdMiddleware adds to every error
        raw = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            (REQUEST_ID_HEADER.lower().encode(), request_id.encode()),
            (b"connection", b"close"),
            *self.headers,
        ]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": raw})


def too_large(route: Route) -> Refusal:
    message = f"The request body is larger than the limit of {route.limit} bytes ({route.setting})."
    if route.setting == "PREVIEW_MAX_BODY_BYTES":
        message += " Send fewer trajectory groups per training job."
    return Refusal(413, message, "body_too_large")


def encoding_refusal(headers: dict[bytes, bytes], route: Route) -> Refusal | None:
    """A 415 for a Content-Encoding the route's views do not decode: such a body would otherwise be
    parsed as if it were plain (the Tinker views decode theirs, bounded: projects.content_encoding)."""
    header = headers.get(b"content-encoding")
    try:
        encoding_of(header.decode("latin-1") if header is not None else None, accepted=route.encodings)
    except UnsupportedEncoding as exc:
        return Refusal(415, exc.message, exc.code)
    return None


def unauthenticated(route: Route, reason: tuple[str, str]) -> Refusal:
    message, code = reason
    # DRF names the scheme to use (its first authenticator's, projects.api.authentication).
    headers = () if route.gateway or route.tinker else ((b"www-authenticate", b"Bearer"),)
    return Refusal(401, message, code, headers)


async def credentials_refusal(scope: Scope, route: Route) -> Refusal | None:
    """None when the request carries valid credentials for ``route``, else its 401. An
    Authorization header decides alone, as in DRF (a bad key is a 401 even beside a session)."""
    headers = _headers(scope)
    if route.tinker:  # as projects.tinker.views._access reads it
        raw = headers.get(b"x-api-key", b"").decode("latin-1")
        if not raw:
            bearer = headers.get(b"authorization", b"").decode("latin-1")
            raw = bearer[7:] if bearer.startswith("Bearer ") else ""
        if not raw:
            return unauthenticated(route, TINKER_MISSING)
        if await _key_valid(scope, raw.removeprefix(TINKER_KEY_PREFIX)):
            return None
        return unauthenticated(route, TINKER_BAD_KEY)
    authorization = headers.get(b"authorization", b"").decode("latin-1")
    if authorization:
        # Each side's own parsing (projects.gateway.views._bearer, ApiKeyAuthentication).
        if route.gateway:
            scheme, _, raw = authorization.partition(" ")
            raw = raw.strip()
            if scheme != "Bearer" or not raw:
                return unauthenticated(route, GATEWAY_MISSING)
        else:
            parts = authorization.split()
            if len(parts) != 2 or parts[0] != "Bearer":
                return unauthenticated(route, API_BAD_SCHEME)
            raw = parts[1]
        if await _key_valid(scope, raw):
            return None
        return unauthenticated(route, GATEWAY_BAD_KEY if route.gateway else API_BAD_KEY)
    if route.sessions:
        cookies = parse_cookie(headers.get(b"cookie", b"").decode("latin-1"))
        session_key = cookies.get(settings.SESSION_COOKIE_NAME)
        if session_key and await in_db_thread(_session_signed_in)(session_key):
            return None
    return unauthenticated(route, GATEWAY_MISSING if route.gateway else API_MISSING)


async def _key_valid(scope: Scope, raw: str) -> bool:
    """Through the gateway's key memory (projects.gateway.lookups), so a gateway request costs no
    second lookup; a key found in the database is left in the scope for DRF."""
    digest = lookups.key_digest(raw)
    if lookups.api_keys.get(digest) is not None:
        return True
    api_key = await in_db_thread(services.api_key_authenticate)(raw=raw)
    if api_key is None:
        return False
    lookups.api_keys.put(digest, api_key, lookups.cache_seconds())
    scope[VERIFIED_KEY] = (digest, api_key)
    return True


def verified_key(scope: Scope | None, raw: str) -> ApiKey | None:
    """The key the gate looked up in the database for this very request, if it was ``raw``."""
    found = (scope or {}).get(VERIFIED_KEY)
    if found is None or not constant_time_compare(found[0], lookups.key_digest(raw)):
        return None
    return found[1]


def _session_signed_in(session_key: str) -> bool:
    """Whether the session is an active user's, by django.contrib.auth.get_user's rules (backend,
    user, session hash incl. the fallback keys) but without its writes: get_user flushes or re-keys
    the session, which AuthenticationMiddleware does anyway when the view runs."""
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    try:
        user_id = auth.get_user_model()._meta.pk.to_python(session[auth.SESSION_KEY])  # type: ignore[union-attr]
        backend_path = session[auth.BACKEND_SESSION_KEY]
    except KeyError:
        return False
    if backend_path not in settings.AUTHENTICATION_BACKENDS:
        return False
    user = auth.load_backend(backend_path).get_user(user_id)
    if user is None:  # gone, or inactive (ModelBackend refuses those)
        return False
    if not hasattr(user, "get_session_auth_hash"):
        return True
    given = session.get(auth.HASH_SESSION_KEY) or ""
    hashes = [user.get_session_auth_hash(), *user.get_session_auth_fallback_hash()]
    return any(constant_time_compare(given, expected) for expected in hashes)


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {name.lower(): value for name, value in scope.get("headers", [])}


def _declared_length(headers: dict[bytes, bytes]) -> int | None:
    """Content-Length, or None without one (or an unreadable one: the stream is counted instead)."""
    value = headers.get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class _CountedBody:
    """The request's ``receive`` as the handler sees it: bytes are counted, and past the limit
    (or at the first byte of a body that its headers did not announce and whose credentials fail)
    the handler gets a disconnect and ``refusal`` says what to answer instead."""

    def __init__(self, receive: Receive, scope: Scope, route: Route, *, credentials_checked: bool) -> None:
        self.receive = receive
        self.scope = scope
        self.route = route
        self.credentials_checked = credentials_checked
        self.received = 0
        self.refusal: Refusal | None = None

    async def __call__(self) -> Message:
        if self.refusal is not None:
            return DISCONNECT
        message = await self.receive()
        if message["type"] != "http.request":
            return message
        chunk = message.get("body", b"")
        if chunk and not self.credentials_checked:
            # Only a server that delivers a body without Content-Length or Transfer-Encoding
            # (HTTP/2) gets here: the first chunk is read, the rest is not.
            self.credentials_checked = True
            self.refusal = await credentials_refusal(self.scope, self.route)
            if self.refusal is not None:
                return DISCONNECT
        self.received += len(chunk)
        if self.received > self.route.limit:
            self.refusal = too_large(self.route)
            return DISCONNECT
        return message


def with_body_limits(app: ASGIApp) -> ASGIApp:
    """``app`` behind the gate described above."""

    async def gate(scope: Scope, receive: Receive, send: Send) -> None:
        route = route_of(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await app(scope, receive, send)
            return
        headers = _headers(scope)
        declared = _declared_length(headers)
        announced = bool(declared) or b"transfer-encoding" in headers
        # Credentials first: a caller without them needs those before a smaller body helps.
        if announced and (refusal := await credentials_refusal(scope, route)) is not None:
            await refusal.send(send)
            return
        if declared is not None and declared > route.limit:
            await too_large(route).send(send)
            return
        if announced and (refusal := encoding_refusal(headers, route)) is not None:
            await refusal.send(send)
            return
        body = _CountedBody(receive, scope, route, credentials_checked=announced)
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await app(scope, body, tracked_send)
        if body.refusal is not None and not started:
            await body.refusal.send(send)

    return gate
