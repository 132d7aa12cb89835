"""Bodies on /api/ and /v1/ are refused before they are read (issue 22; projects.body_limits).

The ASGI application is driven directly, as uvicorn drives it, by a client whose body is made
only when the application asks for it and who counts what it handed out: that count is what the
server read (and Django's handler would have spooled to disk). The last test does the same
through a real uvicorn process over a socket.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
from dataclasses import dataclass

import pytest
from django.conf import settings
from django.test import Client

from projects import body_limits, services
from projects.gateway import lookups
from tests.processes import Process, start_web

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 1024 * 1024
CHUNK = 64 * 1024  # what uvicorn hands over at most per message (its flow-control high-water mark)
BIG = 200 * MiB
ZEROS = bytes(CHUNK)
CSRF_SECRET = "a" * 32  # a well-formed CSRF cookie value; the header repeats it


@pytest.fixture(autouse=True)
def _fresh_key_memory_and_closed_connections():
    lookups.api_keys.clear()  # a key remembered by an earlier test would skip the lookup
    yield
    lookups.api_keys.clear()
    from projects.gateway.db import close_db_thread_connections

    close_db_thread_connections()  # the gate ran its lookups on the gateway's database threads


class Sender:
    """A client sending ``size`` bytes (``content`` if given, else zeros) in CHUNK pieces, each
    made only when the application asks for it; ``handed_out`` counts what it asked for."""

    def __init__(self, size: int = 0, content: bytes | None = None) -> None:
        self.content = content
        self.size = len(content) if content is not None else size
        self.handed_out = 0
        self.receives = 0

    async def receive(self) -> dict:
        self.receives += 1
        if self.handed_out >= self.size and self.receives > 1:
            await asyncio.Event().wait()  # the client stays connected until the answer
        start = self.handed_out
        end = min(self.size, start + CHUNK)
        piece = self.content[start:end] if self.content is not None else ZEROS[: end - start]
        self.handed_out = end
        return {"type": "http.request", "body": piece, "more_body": end < self.size}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict
    read: int  # body bytes the application took from the client

    @property
    def error(self) -> dict:
        assert self.headers["content-type"].startswith("application/json")
        return self.body["error"]


def call(
    path: str,
    sender: Sender,
    *,
    method: str = "POST",
    headers: list[tuple[bytes, bytes]] | None = None,
    length: str = "content-length",
) -> Answer:
    """``length``: how the body is framed: ``content-length`` (its size), ``chunked``
    (Transfer-Encoding, as uvicorn passes it on) or ``none`` (neither header: HTTP/2's way)."""
    from projects.gateway.asgi import application

    framing = {
        "content-length": [(b"content-length", str(sender.size).encode())],
        "chunked": [(b"transfer-encoding", b"chunked")],
        "none": [],
    }[length]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *framing,
                         *(headers or [])],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}  # fmt: skip
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(application(scope, sender.receive, send))
    start = sent[0]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    headers_out = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    body = json.loads(content) if headers_out.get("content-type", "").startswith("application/json") else {}
    return Answer(start["status"], headers_out, body, sender.handed_out)


def bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


def signed_in(user) -> list[tuple[bytes, bytes]]:
    """A browser's headers for ``user``: the session cookie, and the CSRF cookie and header DRF's
    session authentication asks for on a write."""
    client = Client()
    client.force_login(user)
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    cookie = f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={CSRF_SECRET}"
    return [(b"cookie", cookie.encode()), (b"x-csrftoken", CSRF_SECRET.encode())]


# --- without credentials: 401, nothing read -------------------------------------------------------


@pytest.mark.parametrize("length", ["content-length", "chunked"])
@pytest.mark.parametrize(
    "path",
    ["/api/v1/projects/", "/v1/chat/completions", "/v1/preview/training-jobs", "/v1/files", "/v1/fine_tuning/jobs",
     "/tinker/api/v1/create_session"],
)  # fmt: skip
def test_a_200_mb_body_without_a_key_is_a_401_with_nothing_read(cast, path, length):
    answer = call(path, Sender(BIG), length=length)
    assert answer.status == 401, answer.body
    assert answer.read == 0
    assert answer.headers["connection"] == "close"  # or uvicorn reads the rest to reuse the connection
    assert answer.error["request_id"] == answer.headers["x-request-id"]


def test_a_body_without_framing_headers_is_refused_after_its_first_chunk(cast):
    # A server that passes neither Content-Length nor Transfer-Encoding (HTTP/2) on: the gate
    # learns of the body from its first chunk.
    answer = call("/api/v1/projects/", Sender(BIG), length="none")
    assert answer.status == 401
    assert answer.read == CHUNK


@pytest.mark.parametrize(
    ("path", "authorization"),
    [
        ("/api/v1/projects/", None),
        ("/api/v1/projects/", "Bearer aw_nope_nope"),
        ("/api/v1/projects/", "Basic YWxpY2U6cHc="),
        ("/v1/chat/completions", None),
        ("/v1/chat/completions", "Bearer aw_nope_nope"),
        ("/v1/chat/completions", "Basic YWxpY2U6cHc="),
        ("/v1/preview/training-jobs", None),
        ("/v1/preview/training-jobs", "Bearer aw_nope_nope"),
        ("/v1/fine_tuning/jobs", None),
        ("/v1/fine_tuning/jobs", "Bearer aw_nope_nope"),
        ("/tinker/api/v1/create_session", None),
        ("/tinker/api/v1/create_session", "Bearer aw_nope_nope"),
    ],
)
def test_the_gates_401_is_the_one_the_view_gives_for_the_same_request_without_a_body(
    cast, path, authorization
):
    headers = [(b"authorization", authorization.encode())] if authorization else []
    refused = call(path, Sender(BIG), headers=headers)
    viewed = call(path, Sender(0), headers=headers)  # no body: the gate lets it through to the view
    assert refused.status == viewed.status == 401
    assert refused.read == 0
    without_id = [{k: v for k, v in a.error.items() if k != "request_id"} for a in (refused, viewed)]
    assert without_id[0] == without_id[1]
    assert refused.headers.get("www-authenticate") == viewed.headers.get("www-authenticate")


def test_a_revoked_key_is_refused_before_the_body(cast):
    created = services.api_key_create(team=cast.alpha, name="gone")
    services.api_key_revoke(api_key=created.api_key)
    answer = call("/api/v1/projects/", Sender(BIG), headers=bearer(created.plaintext))
    assert answer.status == 401 and answer.read == 0
    assert answer.error["message"] == "invalid or revoked API key"


def test_a_session_cookie_does_not_count_on_the_gateway(cast):
    answer = call("/v1/chat/completions", Sender(BIG), headers=signed_in(cast.alice))
    assert answer.status == 401 and answer.read == 0


# --- with credentials: 413 at the limit -----------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/api/v1/projects/", "/v1/chat/completions", "/v1/preview/training-jobs", "/v1/files",
     "/tinker/api/v1/forward_backward"],
)  # fmt: skip
def test_a_content_length_over_the_limit_is_a_413_before_any_read(cast, alpha_key, path):
    answer = call(path, Sender(BIG), headers=bearer(alpha_key))
    assert answer.status == 413, answer.body
    assert answer.read == 0
    assert answer.error["code"] == "body_too_large"
    assert answer.headers["connection"] == "close"


@pytest.mark.parametrize("path", ["/api/v1/projects/", "/v1/chat/completions"])
def test_a_chunked_200_mb_body_with_a_key_is_cut_at_the_limit(alpha_key, path):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    answer = call(path, Sender(BIG), headers=bearer(alpha_key), length="chunked")
    assert answer.status == 413, answer.body
    assert limit < answer.read <= limit + CHUNK
    assert f"limit of {limit} bytes (DATA_UPLOAD_MAX_MEMORY_SIZE)" in answer.error["message"]
    assert answer.headers["connection"] == "close"


def test_a_chunked_body_on_the_preview_paths_is_cut_at_their_own_limit(settings, alpha_key):
    settings.PREVIEW_MAX_BODY_BYTES = 2 * MiB  # the default is 64 MiB; the rule is the same
    answer = call("/v1/preview/training-jobs", Sender(BIG), headers=bearer(alpha_key), length="chunked")
    assert answer.status == 413
    assert 2 * MiB < answer.read <= 2 * MiB + CHUNK
    assert "PREVIEW_MAX_BODY_BYTES" in answer.error["message"]


def test_a_signed_in_session_gets_the_same_limit(cast):
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    answer = call("/api/v1/projects/", Sender(BIG), headers=signed_in(cast.alice), length="chunked")
    assert answer.status == 413
    assert limit < answer.read <= limit + CHUNK


@pytest.mark.parametrize(
    ("path", "limit", "setting"),
    [
        ("/api/v1/projects/", 10 * MiB, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
        ("/v1/chat/completions", 10 * MiB, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
        ("/v1/preview/training-jobs", 64 * MiB, "PREVIEW_MAX_BODY_BYTES"),
        ("/api/v1/task-sets/", 50 * MiB + body_limits.MULTIPART_OVERHEAD_BYTES, "MAX_TASKSET_BYTES"),
        ("/api/v1/task-sets", 50 * MiB + body_limits.MULTIPART_OVERHEAD_BYTES, "MAX_TASKSET_BYTES"),
        ("/api/v1/task-sets/generate", 10 * MiB, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
        ("/v1/files", 50 * MiB + body_limits.MULTIPART_OVERHEAD_BYTES, "MAX_TASKSET_BYTES"),
        ("/v1/files/file-3", 10 * MiB, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
        ("/v1/fine_tuning/jobs", 10 * MiB, "DATA_UPLOAD_MAX_MEMORY_SIZE"),
        ("/tinker/api/v1/forward_backward", 64 * MiB, "PREVIEW_MAX_BODY_BYTES"),
    ],
)
def test_each_route_takes_its_limit_from_its_setting(settings, path, limit, setting):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * MiB
    settings.PREVIEW_MAX_BODY_BYTES = 64 * MiB
    settings.MAX_TASKSET_BYTES = 50 * MiB
    route = body_limits.route_of(path)
    assert route is not None and (route.limit, route.setting) == (limit, setting)
    assert body_limits.route_of("/projects/new") is None  # the dashboard: Django's own handling


# --- what must keep working -----------------------------------------------------------------------


def test_a_small_post_with_a_key_creates_and_looks_the_key_up_once(settings, monkeypatch, alpha_key):
    settings.GATEWAY_LOOKUP_CACHE_S = 0  # no key memory: only the gate's hand-over saves the lookup
    lookups_made = []
    real = services.api_key_authenticate

    def counted(**kwargs):
        lookups_made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(services, "api_key_authenticate", counted)
    body = json.dumps({"name": "over-asgi", "description": "made through the gate"}).encode()
    answer = call("/api/v1/projects/", Sender(content=body), headers=bearer(alpha_key))
    assert answer.status == 201, answer.body
    assert answer.body["name"] == "over-asgi"
    assert len(lookups_made) == 1


def test_a_small_chunked_body_with_a_key_reaches_the_gateway(alpha_key):
    # (DRF reads no body without a Content-Length, so /api/ would see none: its own behaviour.)
    body = json.dumps({"model": "nowhere/nothing:1", "messages": [{"role": "user", "content": "hi"}]})
    answer = call("/v1/chat/completions", Sender(content=body.encode()), headers=bearer(alpha_key),
                  length="chunked")  # fmt: skip
    assert answer.status == 404, answer.body  # the body was read: it names a model that is not there
    assert "nowhere/nothing:1" in answer.error["message"]


def test_the_tinker_sdks_key_header_passes_the_gate_and_a_bad_one_does_not(cast, alpha_key):
    # The SDK sends X-API-Key: tml-<key> (projects.tinker.views._access reads it the same way).
    body = json.dumps({"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"})
    answer = call("/tinker/api/v1/create_session", Sender(content=body.encode()),
                  headers=[(b"x-api-key", f"tml-{alpha_key}".encode())])  # fmt: skip
    assert answer.status == 200 and answer.body.get("session_id"), answer.body
    refused = call("/tinker/api/v1/create_session", Sender(BIG), headers=[(b"x-api-key", b"tml-aw_nope")])
    assert refused.status == 401 and refused.read == 0
    assert "tml-" in refused.error["message"] and "www-authenticate" not in refused.headers


def test_a_signed_in_session_posts_through_the_gate(cast):
    body = json.dumps({"name": "from-the-dashboard"}).encode()
    answer = call("/api/v1/projects/", Sender(content=body), headers=signed_in(cast.alice))
    assert answer.status == 201, answer.body


def test_a_session_of_a_user_who_changed_password_is_refused(cast):
    headers = signed_in(cast.alice)
    cast.alice.set_password("a-new-password-456")
    cast.alice.save()  # the session's hash no longer matches: Django signs such a session out
    answer = call("/api/v1/projects/", Sender(BIG), headers=headers)
    assert answer.status == 401 and answer.read == 0


def test_the_invitation_accept_route_still_takes_a_signed_in_persons_body(cast):
    body = json.dumps({"token": "inv_nope_nope"}).encode()
    answer = call("/api/v1/invitations/accept", Sender(content=body), headers=signed_in(cast.charlie))
    assert answer.status not in (401, 403, 413), answer.body  # the service's own answer on the token


def test_anonymous_routes_without_a_body_still_answer(cast):
    docs = call("/api/v1/docs/", Sender(0), method="GET", length="none")
    assert docs.status == 200
    health = call("/healthz", Sender(0), method="GET", length="none")
    assert health.status == 200 and health.body == {"status": "ok"}
    missing = call("/api/v1/projekts/", Sender(0), method="GET", length="none")
    assert missing.status == 404 and "did you mean /api/v1/projects/" in missing.error["message"]


def test_the_dashboard_keeps_djangos_handling(cast):
    # Outside /api and /v1 the gate does nothing: Django reads the body and its CSRF check answers.
    answer = call("/login/", Sender(content=b"username=alice"), length="content-length")
    assert answer.status == 403 and answer.read == len(b"username=alice")


# --- through a real uvicorn -----------------------------------------------------------------------


@pytest.fixture
def uvicorn(tmp_path) -> Process:
    process = start_web(tmp_path)
    yield process
    process.stop()


def written_bytes(pid: int) -> int:
    """What the process wrote (write(2) calls: a body spooled to a temporary file is counted)."""
    with open(f"/proc/{pid}/io") as io:
        return int(dict(line.split(": ") for line in io.read().splitlines())["wchar"])


def send_until_answered(
    url: str, path: str, *, extra: str = "", chunked: bool, total: int = BIG
) -> tuple[int, int]:
    """POST ``total`` bytes of body to ``path`` as fast as the server takes them, stopping when it
    answers or closes. ``extra``: more header lines. Returns (status, body bytes the client got
    into the connection): an upper bound on what the server read, the rest of the difference
    sitting in the kernel's socket buffers."""
    host, port = url.removeprefix("http://").split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total}"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{framing}\r\n{extra}\r\n"
    )
    piece = (b"%x\r\n" % CHUNK + ZEROS + b"\r\n") if chunked else ZEROS
    sent, reply = 0, b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        while sent < total and not select.select([sock], [], [], 0)[0]:  # until the server answers
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += CHUNK
        try:
            while b"\r\n\r\n" not in reply and (more := sock.recv(65536)):
                reply += more
        except ConnectionResetError:
            pass
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
    return status, sent


@pytest.mark.integration
def test_uvicorn_reads_and_spools_almost_nothing_of_a_200_mb_body(uvicorn, alpha_key, capsys):
    pid = uvicorn.process.pid
    before = written_bytes(pid)
    status, anonymous_sent = send_until_answered(uvicorn.url, "/api/v1/projects/", chunked=False)
    anonymous_written = written_bytes(pid) - before
    assert status == 401
    assert anonymous_sent < 16 * MiB, anonymous_sent  # before the gate: all 200 MB, spooled to disk
    assert anonymous_written < MiB, anonymous_written

    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    before = written_bytes(pid)
    status, keyed_sent = send_until_answered(
        uvicorn.url, "/api/v1/projects/", extra=f"Authorization: Bearer {alpha_key}\r\n", chunked=True
    )
    keyed_written = written_bytes(pid) - before
    assert status == 413
    assert limit < keyed_sent < limit + 16 * MiB, keyed_sent
    assert keyed_written < limit + MiB, keyed_written  # what Django spooled before the cut
    with capsys.disabled():
        print(f"\nuvicorn, 200 MB body: without a key {anonymous_sent} bytes sent, {anonymous_written} "
              f"written; with a key (chunked) {keyed_sent} sent, {keyed_written} written")  # fmt: skip
