"""Compressed request bodies are bounded like bodies (issue 51, must-have 1): a zstd body that
decodes past the route's limit is a 413, whether or not its frame declares its size, and the web
process never holds much more than the limit while finding out; broken or concatenated frames are
a 400; a Content-Encoding no view decodes is a 415, at the ASGI gate and in the Tinker views."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest
import zstandard
from django.test import Client

from projects import services
from tests.asgi import asgi_json

LIMIT = 1024 * 1024  # PREVIEW_MAX_BODY_BYTES in these tests: the Tinker routes' limit
GIB = 1024 * 1024 * 1024


def zstd_of_zeros(total: int, *, declared: bool) -> bytes:
    """``total`` zero bytes as one zstd frame (about 32 KB for 1 GiB), its size declared or not."""
    sink = io.BytesIO()
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    chunk = bytes(1024 * 1024)
    with compressor.stream_writer(sink, size=total if declared else -1, closefd=False) as writer:
        for _ in range(total // len(chunk)):
            writer.write(chunk)
    return sink.getvalue()


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    return {"declared": zstd_of_zeros(GIB, declared=True), "undeclared": zstd_of_zeros(GIB, declared=False)}


@pytest.fixture
def tinker_key(cast, settings) -> str:
    settings.PREVIEW_MAX_BODY_BYTES = LIMIT
    return "tml-" + services.api_key_create(team=cast.alpha, name="ci").plaintext


def post(key: str, route: str, body: bytes, encoding: str | None):
    headers = {"HTTP_X_API_KEY": key}
    if encoding is not None:
        headers["HTTP_CONTENT_ENCODING"] = encoding
    return Client().post(f"/tinker/api/v1/{route}", data=body, content_type="application/json", **headers)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.content[:300]
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def test_the_bombs_are_small_and_say_what_they_say(bombs):
    assert len(bombs["declared"]) < 64 * 1024 and len(bombs["undeclared"]) < 64 * 1024
    assert zstandard.get_frame_parameters(bombs["declared"]).content_size == GIB
    assert zstandard.get_frame_parameters(bombs["undeclared"]).content_size == zstandard.CONTENTSIZE_UNKNOWN


@pytest.mark.parametrize("kind", ["declared", "undeclared"])
def test_a_zstd_bomb_is_a_413_and_the_process_grows_by_less_than_twice_the_limit(tinker_key, bombs, kind):
    """The 32 KB frame that decodes to 1 GiB, on the route that drops its body."""
    post(tinker_key, "telemetry", zstandard.ZstdCompressor().compress(b"{}"), "zstd")  # imports, caches warm
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        response = post(tinker_key, "telemetry", bombs[kind], "zstd")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    error = error_of(response, 413)
    assert "PREVIEW_MAX_BODY_BYTES" in error["message"] and "decompressed" in error["message"]
    assert peak < 2 * LIMIT, f"the request grew the process by {peak} bytes (limit {LIMIT})"


def test_a_zstd_body_within_the_limit_is_read_as_its_json(tinker_key):
    body = json.dumps({"tags": ["x" * 100] * 50, "sdk_version": "0.38.0"}).encode()
    response = post(tinker_key, "telemetry", zstandard.ZstdCompressor().compress(body), "zstd")
    assert response.status_code == 200, response.content
    # Exactly at the limit still passes; one byte over does not (the stream is cut at limit + 1).
    at_limit = json.dumps({"pad": "x" * (LIMIT - 11)}).encode()
    assert len(at_limit) == LIMIT
    assert (
        post(tinker_key, "telemetry", zstandard.ZstdCompressor().compress(at_limit), "ZSTD").status_code
        == 200
    )
    over = zstandard.ZstdCompressor(write_content_size=False).compress(at_limit + b" ")
    assert error_of(post(tinker_key, "telemetry", over, "zstd"), 413)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not zstd at all", "not a zstd frame"),
        (zstandard.ZstdCompressor().compress(b'{"a": 1}' * 100)[:-5], "cut short"),
        (
            zstandard.ZstdCompressor().compress(b"{}") + zstandard.ZstdCompressor().compress(b"{}"),
            "one zstd frame",
        ),
        (zstandard.ZstdCompressor().compress(b"{}") + b"trailing garbage", "one zstd frame"),
    ],
)
def test_a_broken_or_concatenated_zstd_body_is_a_400_saying_so(tinker_key, body, reason):
    error = error_of(post(tinker_key, "create_session", body, "zstd"), 400)
    assert reason in error["message"], error


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd, gzip", "x-unknown"])
def test_an_encoding_the_tinker_views_do_not_decode_is_a_415_not_parsed_as_plain(tinker_key, encoding):
    error = error_of(post(tinker_key, "create_session", b"{}", encoding), 415)
    assert "Content-Encoding" in error["message"] and "zstd" in error["message"]
    assert post(tinker_key, "create_session", b"{}", "identity").status_code == 200


# --- the ASGI gate, in front of every route (the gateway's /v1/ has no Django middleware) ---------


def asgi(path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    return asgi_json("POST", path, body, headers)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("path", "encoding"),
    [("/v1/chat/completions", b"gzip"), ("/api/v1/projects/", b"deflate"), ("/v1/files", b"zstd"),
     ("/v1/preview/models", b"zstd"), ("/tinker/api/v1/create_session", b"gzip")],
)  # fmt: skip
def test_the_gate_refuses_an_encoding_the_route_does_not_decode_with_a_415(path, encoding, cast):
    from projects.gateway.db import close_db_thread_connections

    key = services.api_key_create(team=cast.alpha, name="ci").plaintext
    try:
        status, body = asgi(path, b"{}", [(b"authorization", f"Bearer {key}".encode()),
                                          (b"x-api-key", f"tml-{key}".encode()), (b"content-encoding", encoding)])  # fmt: skip
    finally:
        close_db_thread_connections()
    assert status == 415, body
    assert body["error"]["code"] == "unsupported_media_type" and encoding.decode() in body["error"]["message"]
