"""The inference server resolves a stored checkpoint (key + digest headers, as the gateway sends
them) through the fetcher serve_inference gives it: fetched once into its cache, verified, loaded;
a digest that does not match is a 502, a key with nothing stored a 404, and the path header of
another host is not needed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from projects.storage import S3CheckpointStore, checkpoint_key
from tests.projects.test_storage import s3_client, s3_endpoint  # noqa: F401
from training.serving.app import InferenceApp, ServerConfig
from training.serving.protocol import ADAPTER_HEADER, ADAPTER_KEY_HEADER, ADAPTER_SHA256_HEADER, MODEL_HEADER


async def post(app: InferenceApp, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": "it/m:1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body.encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def serve(app: InferenceApp, scenario: Callable[[], Awaitable[None]]) -> None:
    """Run ``scenario`` on one event loop with the app's scheduler running (as the server does)."""

    async def main() -> None:
        task = asyncio.create_task(app.scheduler.run())
        try:
            await scenario()
        finally:
            task.cancel()

    asyncio.run(main())


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """A checkpoint folder exactly as the trainer writes it."""
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.policy import Policy

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    folder = tmp_path_factory.mktemp("writer") / "step-000001"
    Policy(model, tokenizer, TrainConfig(), LoraSpec()).save_checkpoint(folder, step=1, metrics={})
    return folder


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from training.base_models import load_base_model
    from training.engines.transformers_engine import TransformersEngine

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    return TransformersEngine(model, tokenizer)


def test_a_stored_checkpoint_is_fetched_verified_and_served(
    engine,
    trained_checkpoint,
    tmp_path,
    s3_endpoint,  # noqa: F811
):
    s3_client(s3_endpoint).create_bucket(Bucket="serving")
    writer = S3CheckpointStore(
        client=s3_client(s3_endpoint), bucket="serving", prefix="p", cache_dir=tmp_path / "writer"
    )
    key = checkpoint_key(model_id=7, step=1)
    stored = writer.put_dir(key, trained_checkpoint)
    cache = tmp_path / "inference-cache"
    reader = S3CheckpointStore(client=s3_client(s3_endpoint), bucket="serving", prefix="p", cache_dir=cache)
    fetches: list[str] = []

    def fetch(key: str, sha256: str) -> Path:
        fetches.append(key)
        return reader.fetch_dir(key, sha256=sha256)

    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=cache, adapter_fetch=fetch))
    headers = {
        MODEL_HEADER: "it/m:1",
        ADAPTER_HEADER: "/elsewhere/model-7/step-000001",  # the writer's path: not on this host
        ADAPTER_KEY_HEADER: key,
        ADAPTER_SHA256_HEADER: stored.sha256,
    }

    async def scenario() -> None:
        status, body = await post(app, headers)
        assert status == 200, body
        assert body["model"] == "it/m:1"
        assert app.adapters.loaded() == [str((cache / key).resolve())]
        assert (await post(app, headers))[0] == 200
        assert fetches == [key], "fetched once, then served from the cache"

        status, body = await post(app, {**headers, ADAPTER_SHA256_HEADER: "0" * 64})
        assert (status, body["error"]["code"]) == (502, "adapter_fetch_failed")
        assert "digest" in body["error"]["message"]

        def fetch_missing(key: str, sha256: str) -> Path:
            raise FileNotFoundError(key)

        app.config.adapter_fetch = fetch_missing
        status, body = await post(app, {**headers, ADAPTER_KEY_HEADER: "model-7/step-000009"})
        assert (status, body["error"]["code"]) == (404, "model_not_found")

    serve(app, scenario)


def test_without_a_fetcher_the_path_header_is_used(engine, trained_checkpoint):
    app = InferenceApp(engine, ServerConfig(model_name="tiny", adapter_root=trained_checkpoint.parent))
    headers = {
        MODEL_HEADER: "it/m:1",
        ADAPTER_HEADER: str(trained_checkpoint),
        ADAPTER_KEY_HEADER: "model-7/step-000001",
        ADAPTER_SHA256_HEADER: "0" * 64,
    }

    async def scenario() -> None:
        status, body = await post(app, headers)
        assert status == 200, body

    serve(app, scenario)
    assert app.adapters.loaded() == [str(trained_checkpoint.resolve())]


def test_serve_inference_fetches_into_its_adapter_root(settings, tmp_path, s3_endpoint):  # noqa: F811
    from artweb.management.commands.serve_inference import stored_adapter_fetch

    s3_client(s3_endpoint).create_bucket(Bucket="serve-cmd")
    settings.STORAGE_BACKEND = "s3"
    settings.STORAGE_S3_BUCKET = "serve-cmd"
    settings.STORAGE_S3_ENDPOINT_URL = s3_endpoint
    settings.STORAGE_S3_ACCESS_KEY_ID = settings.STORAGE_S3_SECRET_ACCESS_KEY = "test"
    settings.INFERENCE_CACHE_DIR = tmp_path / "adapters"
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    from projects.storage import checkpoint_store

    stored = checkpoint_store(cache_dir=tmp_path / "w").put_dir("model-1/step-000001", folder)
    fetch = stored_adapter_fetch()
    assert fetch("model-1/step-000001", stored.sha256) == tmp_path / "adapters" / "model-1" / "step-000001"
    with pytest.raises(FileNotFoundError):
        fetch("model-1/step-000002", stored.sha256)


@pytest.mark.parametrize("cache", ["checkpoints", "checkpoints/fetched", "."])
def test_serve_inference_refuses_a_fetch_cache_overlapping_the_checkpoint_dir(settings, tmp_path, cache):
    """Eviction deletes folders in the fetch cache: it must never reach what a trainer wrote."""
    from django.core.management.base import CommandError

    from artweb.management.commands.serve_inference import fetch_cache_options

    settings.STORAGE_BACKEND = "s3"
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    settings.INFERENCE_CACHE_DIR = (tmp_path / cache).resolve()
    with pytest.raises(CommandError, match="INFERENCE_CACHE_DIR"):
        fetch_cache_options()


def test_serve_inference_budgets_its_own_fetch_cache_only_with_a_bucket(settings, tmp_path):
    from artweb.management.commands.serve_inference import fetch_cache_options

    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    settings.INFERENCE_CACHE_DIR = tmp_path / "inference-cache"
    settings.INFERENCE_CACHE_BUDGET_BYTES = 123
    settings.STORAGE_BACKEND = "local"
    assert fetch_cache_options() == {}  # the local store's folders are the store: never evicted
    settings.STORAGE_BACKEND = "s3"
    assert fetch_cache_options() == {
        "fetch_cache_root": tmp_path / "inference-cache",
        "fetch_cache_budget_bytes": 123,
    }
