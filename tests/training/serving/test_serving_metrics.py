"""The inference server's Prometheus series (training.serving.metrics): requests by status, batch
size per step, time to first token, tokens, and the adapter cache; /metrics behind the token."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from training.serving import metrics
from training.serving.adapters import AdapterCache
from training.serving.app import InferenceApp, ServerConfig


def serve(
    app: InferenceApp, calls: list[tuple[str, str, dict | None, dict[str, str]]]
) -> list[tuple[int, bytes]]:
    """Start the app's lifespan, make ``calls`` (method, path, JSON body, headers) one by one, stop."""

    async def main() -> list[tuple[int, bytes]]:
        startup: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        await startup.put({"type": "lifespan.startup"})

        async def lifespan_send(message: dict[str, Any]) -> None:
            pass

        lifespan = asyncio.create_task(app({"type": "lifespan"}, startup.get, lifespan_send))
        await asyncio.sleep(0)
        results = []
        for method, path, body, headers in calls:
            sent: list[dict[str, Any]] = []
            incoming = [
                {
                    "type": "http.request",
                    "body": json.dumps(body).encode() if body else b"",
                    "more_body": False,
                }
            ]

            async def receive(incoming: list[dict[str, Any]] = incoming) -> dict[str, Any]:
                if incoming:
                    return incoming.pop()
                await asyncio.Event().wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any], sent: list[dict[str, Any]] = sent) -> None:
                sent.append(message)

            scope = {"type": "http", "method": method, "path": path,
                     "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
            await app(scope, receive, send)
            status = next(m["status"] for m in sent if m["type"] == "http.response.start")
            results.append(
                (status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
            )
        await startup.put({"type": "lifespan.shutdown"})
        await lifespan
        return results

    return asyncio.run(main())


def _sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_requests_tokens_batch_sizes_and_first_tokens_are_counted(engine, tmp_path):
    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=tmp_path, token="t0k"))
    auth = {"Authorization": "Bearer t0k"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 3}
    before = {
        "ok": _sample("artweb_inference_requests_total", status="200"),
        "missing": _sample("artweb_inference_requests_total", status="404"),
        "tokens": _sample("artweb_inference_tokens_total"),
        "steps": _sample("artweb_inference_batch_size_count"),
        "first": _sample("artweb_inference_time_to_first_token_seconds_count"),
    }
    results = serve(app, [
        ("POST", "/v1/chat/completions", chat, auth),
        ("POST", "/v1/chat/completions", {**chat, "stream": True}, auth),
        ("POST", "/v1/chat/completions", {**chat, "model": "nope"}, auth),
        ("GET", "/metrics", None, {}),
        ("GET", "/metrics", None, auth),
    ])  # fmt: skip
    statuses = [status for status, _ in results]
    assert statuses == [200, 200, 404, 401, 200]
    completion_tokens = json.loads(results[0][1])["usage"]["completion_tokens"]
    assert _sample("artweb_inference_requests_total", status="200") == before["ok"] + 2
    assert _sample("artweb_inference_requests_total", status="404") == before["missing"] + 1
    assert _sample("artweb_inference_tokens_total") >= before["tokens"] + completion_tokens + 1
    assert _sample("artweb_inference_batch_size_count") > before["steps"]  # one per decode step
    assert _sample("artweb_inference_time_to_first_token_seconds_count") == before["first"] + 1  # the stream
    names = {family.name for family in text_string_to_metric_families(results[4][1].decode())}
    assert {
        "artweb_inference_requests",
        "artweb_inference_batch_size",
        "artweb_inference_loaded_adapters",
    } <= names


class FakeEngine:
    def __init__(self) -> None:
        self.loaded: set[str] = set()

    def load_adapter(self, name: str, path: Path) -> None:
        self.loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        self.loaded.discard(name)


def test_the_adapter_cache_counts_loads_evictions_and_what_is_loaded(tmp_path):
    loads, evictions = (
        _sample("artweb_inference_adapter_loads_total"),
        _sample("artweb_inference_adapter_evictions_total"),
    )
    cache = AdapterCache(FakeEngine(), capacity=2)
    for step in (1, 2, 1, 3):
        cache.acquire(tmp_path / f"step-{step}")
    assert _sample("artweb_inference_adapter_loads_total") == loads + 3
    assert _sample("artweb_inference_adapter_evictions_total") == evictions + 1
    assert _sample("artweb_inference_loaded_adapters") == 2
    assert metrics.exposition()[1].startswith("text/plain")
