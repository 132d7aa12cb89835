"""No model server answers around the token (issue 51): a walk over each server's own route list —
the inference server's (training.serving.app.ROUTES), the checkpoint fetcher's
(training.serving.fetch_server.ROUTES), the trainer service's (its documented routes) and vLLM's
known routes behind the guard it runs with (training.serving.vllm_guard) — finds a 401 without the
token, or with a wrong one, on every route but a bare ``GET /health``; and a server without a token
refuses to listen anywhere but loopback."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest

from training.serving.app import ROUTES as INFERENCE_ROUTES
from training.serving.app import InferenceApp, ServerConfig
from training.serving.binding import InsecureBindError, check_bind
from training.serving.fetch_cache import FetchedCheckpoints
from training.serving.fetch_server import ROUTES as FETCH_ROUTES
from training.serving.fetch_server import start_fetch_server
from training.serving.vllm_guard import BearerTokenGuard

TOKEN = "server-secret"
# Paths and methods no server serves: refused before routing too (a 404 would say what exists).
UNKNOWN = [("GET", "/"), ("GET", "/v1/chat/completions"), ("POST", "/nope"), ("DELETE", "/stats"),
           ("POST", "/health"), ("GET", "/health/"), ("GET", "//v1/models")]  # fmt: skip
# vLLM's OpenAI server's routes (vllm.entrypoints.openai.api_server and the routers it attaches:
# serve, sagemaker, pooling, speech-to-text, render, disaggregation, elastic EP, dev mode, docs).
# Only /v1/* checks vLLM's own --api-key; the guard must refuse every one but GET /health.
VLLM_ROUTES = [
    ("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/load"), ("GET", "/version"),
    ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/invocations"),
    ("POST", "/pooling"), ("POST", "/classify"), ("POST", "/score"), ("POST", "/rerank"),
    ("POST", "/v1/score"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"), ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"),
    ("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/inference/v1/generate"), ("POST", "/v1/chat/completions/render"), ("POST", "/v1/completions/render"),
    ("POST", "/scale_elastic_ep"), ("POST", "/is_scaling_elastic_ep"),
    ("POST", "/reset_prefix_cache"), ("POST", "/reset_mm_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
    ("GET", "/is_sleeping"), ("POST", "/collective_rpc"), ("GET", "/server_info"), ("POST", "/pause"),
    ("POST", "/resume"), ("GET", "/is_paused"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"),
]  # fmt: skip


def asgi_call(app: Any, method: str, path: str, token: str | None) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    headers = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


# ----------------------------------------------------------------------------- inference server
def test_every_inference_server_route_but_health_needs_the_token(engine, tmp_path):
    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path, token=TOKEN))
    walked = list(INFERENCE_ROUTES) + UNKNOWN
    assert ("POST", "/v1/chat/completions") in walked and ("GET", "/metrics") in walked
    for method, path in walked:
        for token in (None, "wrong", ""):
            status, body = asgi_call(app, method, path, token)
            assert status == 401, (method, path, token, body)
            assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert asgi_call(app, "GET", "/health", None)[0] == 200  # liveness: the one open route
    # The table is what is served: with the token, its read routes answer.
    for method, path in INFERENCE_ROUTES:
        if method == "GET":
            assert asgi_call(app, method, path, TOKEN)[0] == 200, path


# ----------------------------------------------------------------------------- checkpoint fetcher
def http(url: str, method: str, token: str | None) -> int:
    request = urllib.request.Request(
        url, data=b"{}" if method in ("POST", "PUT", "PATCH") else None, method=method
    )
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_every_checkpoint_fetcher_route_needs_the_token(tmp_path):
    def fetch(key: str, sha256: str) -> Any:
        raise FileNotFoundError(key)

    server = start_fetch_server(FetchedCheckpoints(fetch, root=None), host="127.0.0.1", port=0, token=TOKEN)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        walked = list(FETCH_ROUTES) + UNKNOWN + [("PUT", "/metrics"), ("PATCH", "/x"), ("OPTIONS", "/")]
        for method, path in walked:
            for token in (None, "wrong"):
                assert http(url + path, method, token) == 401, (method, path, token)
        assert http(url + "/metrics", "GET", TOKEN) == 200
    finally:
        server.shutdown()


def test_a_fetcher_without_a_token_listens_on_loopback_only(tmp_path):
    cache = FetchedCheckpoints(lambda key, sha256: tmp_path, root=None)
    with pytest.raises(InsecureBindError, match="needs a token"):
        start_fetch_server(cache, host="0.0.0.0", port=0, token="")


# ----------------------------------------------------------------------------- trainer service
def documented_trainer_routes() -> list[tuple[str, str]]:
    import training.hosting.service as module

    found = re.findall(r"^\s+(GET|POST|DELETE)\s+(/\S+)", module.__doc__ or "", flags=re.MULTILINE)
    return [(method, path.replace("{id}", "s-1")) for method, path in found]


def test_every_trainer_service_route_but_health_needs_the_token(tmp_path):
    from training.hosting.pool import SessionPool
    from training.hosting.service import ServiceConfig, TrainerService

    def never(source: str) -> Any:
        raise AssertionError("nothing is loaded without the token")

    service = TrainerService(
        SessionPool(never, spill_dir=tmp_path / "spill"), ServiceConfig(root=tmp_path, token=TOKEN)
    )
    routes = documented_trainer_routes()
    assert len(routes) >= 12 and ("POST", "/sessions/s-1/sample") in routes, routes
    for method, path in routes + UNKNOWN:
        for token in (None, "wrong"):
            assert asgi_call(service, method, path, token)[0] == 401, (method, path, token)
    assert asgi_call(service, "GET", "/health", None)[0] == 200
    assert asgi_call(service, "GET", "/stats", TOKEN)[0] == 200


# ----------------------------------------------------------------------------- vLLM
def reaches(guard: BearerTokenGuard, method: str, path: str, token: str | None) -> bool:
    reached: list[str] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"served"})

    guard.app = inner
    status, _ = asgi_call(guard, method, path, token)
    assert (status == 200) == bool(reached) and status in (200, 401), status
    return bool(reached)


def test_vllm_behind_the_guard_answers_no_route_but_health_without_the_token():
    guard = BearerTokenGuard(None, token=TOKEN)
    for method, path in VLLM_ROUTES + UNKNOWN:
        if (method, path) == ("GET", "/health"):
            assert reaches(guard, method, path, None)
            continue
        for token in (None, "wrong", ""):
            assert not reaches(guard, method, path, token), (method, path, token)
        assert reaches(guard, method, path, TOKEN), (method, path)


def test_the_guard_reads_vllms_key_and_without_one_refuses_everything_but_health(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    assert reaches(BearerTokenGuard(None), "POST", "/tokenize", TOKEN)
    assert not reaches(BearerTokenGuard(None), "POST", "/tokenize", None)
    monkeypatch.delenv("VLLM_API_KEY")
    unset = BearerTokenGuard(None)
    assert not reaches(unset, "POST", "/tokenize", "") and not reaches(unset, "GET", "/metrics", "anything")
    assert reaches(unset, "GET", "/health", None)


def test_the_guard_closes_websockets_and_passes_lifespan():
    events: list[Any] = []

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        events.append(scope["type"])

    async def send(message: dict[str, Any]) -> None:
        events.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    guard = BearerTokenGuard(inner, token=TOKEN)
    asyncio.run(guard({"type": "websocket", "path": "/v1/realtime", "headers": []}, receive, send))
    asyncio.run(guard({"type": "lifespan"}, receive, send))
    assert events == [{"type": "websocket.close", "code": 1008}, "lifespan"]


def test_vllm_adds_the_guard_the_way_starlette_builds_middleware(monkeypatch):
    """vLLM's ``--middleware`` does ``app.add_middleware(cls)``: Starlette builds it with the app as
    its one argument; the guard then sits in front of every route of a Starlette app."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    def answer(request: Any) -> PlainTextResponse:
        return PlainTextResponse("served")

    methods: dict[str, set[str]] = {}
    for method, path in VLLM_ROUTES:
        methods.setdefault(path, set()).add(method)
    app = Starlette(routes=[Route(path, answer, methods=sorted(ms)) for path, ms in methods.items()])
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    app.add_middleware(BearerTokenGuard)
    client = TestClient(app)
    for method, path in VLLM_ROUTES:
        open_route = (method, path) == ("GET", "/health")
        assert client.request(method, path).status_code == (200 if open_route else 401), (method, path)
        authorized = client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert authorized.status_code == 200 and authorized.text == "served", (method, path)


def test_the_vllm_launcher_runs_vllm_with_the_guard_importable():
    from pathlib import Path

    from training.serving.vllm import VLLMServeOptions, vllm_serve_command

    command, env = vllm_serve_command(
        VLLMServeOptions(model_dir=Path("/m"), served_model_name="m", api_key=TOKEN),
        ["python", "-m", "vllm.entrypoints.openai.api_server"],
        python_path="/extra",
    )
    assert command[command.index("--middleware") + 1] == "training.serving.vllm_guard.BearerTokenGuard"
    assert env["VLLM_API_KEY"] == TOKEN and TOKEN not in " ".join(command)
    root, extra = env["PYTHONPATH"].split(":")
    assert (Path(root) / "training" / "serving" / "vllm_guard.py").is_file() and extra == "/extra"


# ----------------------------------------------------------------------------- where servers listen
@pytest.mark.parametrize(
    ("host", "token", "dev", "refusal"),
    [
        ("0.0.0.0", "", False, "is not set"),
        ("10.0.0.5", "", False, "is not set"),
        ("0.0.0.0", "", True, "only on a loopback host"),
        ("", "", True, "only on a loopback host"),
        ("8.8.8.8", TOKEN, False, "public address"),
        ("127.0.0.1", "", False, "is not set"),  # the dev flag is explicit, even on loopback
    ],
)
def test_a_server_without_a_token_is_refused_off_loopback(host, token, dev, refusal):
    with pytest.raises(InsecureBindError, match=refusal):
        check_bind(host, token=token, dev_no_token=dev, token_variable="X_TOKEN", what="a server")


@pytest.mark.parametrize(
    ("host", "token", "dev"),
    [
        ("127.0.0.1", "", True),
        ("::1", "", True),
        ("localhost", "", True),
        ("0.0.0.0", TOKEN, False),
        ("10.0.0.5", TOKEN, False),
    ],  # fmt: skip
)
def test_a_token_or_a_loopback_dev_server_may_listen(host, token, dev):
    check_bind(host, token=token, dev_no_token=dev, token_variable="X_TOKEN", what="a server")


def test_serve_refuses_a_token_less_app_on_a_reachable_socket():
    import socket

    from training.serving.server import serve

    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        with pytest.raises(InsecureBindError):
            serve(object(), sock=sock, url="http://x", token="")  # type: ignore[arg-type]
