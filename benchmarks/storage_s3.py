"""Checkpoint storage figures: S3 upload/download time per checkpoint, and the first request for a
checkpoint on a cold inference server (download + verify + load) against a warm one.

    .venv/bin/python benchmarks/storage_s3.py [--bundled] [--repeat 3]

Against a real S3 HTTP server on loopback (moto's ``moto_server``, started here; a network bucket
adds its round trips and bandwidth on top). Checkpoints are real ones written by the trainer:
the tiny test model's, and with ``--bundled`` the bundled SmolLM2-135M's (LoRA at the default
rank, adapter + optimizer + RNG state). References measured in the same run: the local store
(copy + digest) for transfers, and a request with the adapter already loaded for serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL_HEADER_NAME = "x-artweb-model"  # training.serving.protocol.MODEL_HEADER (imported after django.setup)
sys.path.insert(0, str(ROOT))


def start_moto_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            return process, endpoint
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise SystemExit("moto_server did not start (pip install -e .[dev])") from None
            time.sleep(0.2)


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def write_checkpoint(source: str, cache_dir: Path, folder: Path) -> tuple[Any, Any]:
    """A checkpoint as training writes it; returns the (model, tokenizer) loaded for it."""
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.session.policy import Policy

    model, tokenizer = load_base_model(source, cache_dir, device="cpu")
    trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec())
    # One optimizer step on zero gradients: AdamW's moments exist, so the checkpoint has the size
    # of a trained one (adapter + 2x adapter of optimizer state), without a rollout.
    for parameter in trainer.policy.parameters():
        if parameter.requires_grad:
            parameter.grad = parameter.detach().new_zeros(parameter.shape)
    trainer.optimizer.step()
    trainer.save_checkpoint(folder, step=1, metrics={})
    return load_base_model(source, cache_dir, device="cpu")


async def post(app: Any, headers: dict[str, str]) -> float:
    """Seconds for one chat completion through the app (ASGI, in process)."""
    body = json.dumps(
        {
            "model": "b/m:1",
            "messages": [{"role": "user", "content": "Say a"}],
            "max_tokens": 4,
            "temperature": 0,
        }
    ).encode()
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

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
    started = time.perf_counter()
    await app(scope, receive, send)
    seconds = time.perf_counter() - started
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    if status != 200:
        raise SystemExit(f"request failed: {sent}")
    return seconds


def base_cold_warm(app: Any, headers: dict[str, str]) -> tuple[float, float, float]:
    """The base model, then the checkpoint twice, on one event loop with the scheduler running."""

    async def scenario() -> tuple[float, float, float]:
        task = asyncio.create_task(app.scheduler.run())
        try:
            base = await post(app, {MODEL_HEADER_NAME: headers[MODEL_HEADER_NAME]})
            return base, await post(app, headers), await post(app, headers)
        finally:
            task.cancel()

    return asyncio.run(scenario())


def measure(
    name: str, source: str, cache_dir: Path, endpoint: str, work: Path, repeat: int
) -> dict[str, Any]:
    from projects.storage import LocalCheckpointStore, S3CheckpointStore, folder_digest
    from training.engines.transformers_engine import TransformersEngine
    from training.serving.app import InferenceApp, ServerConfig
    from training.serving.protocol import ADAPTER_KEY_HEADER, ADAPTER_SHA256_HEADER, MODEL_HEADER

    assert MODEL_HEADER == MODEL_HEADER_NAME
    folder = work / name / "step-000001"
    model, tokenizer = write_checkpoint(source, cache_dir, folder)
    size = folder_digest(folder).size_bytes
    adapter = (folder / "adapter_model.safetensors").stat().st_size
    client = s3_client(endpoint)
    bucket = f"bench-{name}"
    client.create_bucket(Bucket=bucket)

    local_put, local_fetch, s3_put, s3_cold, s3_warm = [], [], [], [], []
    for i in range(repeat):
        key = f"model-{i}/step-000001"
        local = LocalCheckpointStore(work / name / f"local-{i}")
        seconds, stored = timed(lambda local=local, key=key: local.put_dir(key, folder))
        local_put.append(seconds)
        local_fetch.append(
            timed(lambda local=local, key=key, sha=stored.sha256: local.fetch_dir(key, sha256=sha))[0]
        )
        writer = S3CheckpointStore(client=client, bucket=bucket, prefix="b", cache_dir=work / name / f"w-{i}")
        seconds, stored = timed(lambda writer=writer, key=key: writer.put_dir(key, folder))
        s3_put.append(seconds)
        reader = S3CheckpointStore(client=client, bucket=bucket, prefix="b", cache_dir=work / name / f"r-{i}")
        s3_cold.append(
            timed(lambda reader=reader, key=key, sha=stored.sha256: reader.fetch_dir(key, sha256=sha))[0]
        )
        s3_warm.append(
            timed(lambda reader=reader, key=key, sha=stored.sha256: reader.fetch_dir(key, sha256=sha))[0]
        )

    # Serving: a fresh server cache for each checkpoint key (cold), then the same request again.
    engine = TransformersEngine(model, tokenizer, device="cpu")
    cold, warm, base, fetch = [], [], [], []
    for i in range(repeat):
        key = f"model-{i}/step-000001"
        cache = work / name / f"serve-{i}"
        reader = S3CheckpointStore(client=client, bucket=bucket, prefix="b", cache_dir=cache)

        def fetch_timed(key: str, sha256: str, reader: Any = reader) -> Path:
            seconds, path = timed(lambda: reader.fetch_dir(key, sha256=sha256))
            fetch.append(seconds)
            return Path(path)

        app = InferenceApp(
            engine, ServerConfig(model_name="base", adapter_root=cache, adapter_fetch=fetch_timed)
        )
        sha = reader.stat(key).sha256  # type: ignore[union-attr]
        headers = {MODEL_HEADER: "b/m:1", ADAPTER_KEY_HEADER: key, ADAPTER_SHA256_HEADER: sha}
        seconds = base_cold_warm(app, headers)
        base.append(seconds[0])
        cold.append(seconds[1])
        warm.append(seconds[2])
        engine.unload_adapter(app.adapters.acquire(cache / key))  # the next round starts unloaded
    median = statistics.median
    return {
        "checkpoint": name,
        "bytes": size,
        "adapter_bytes": adapter,
        "local_put_s": median(local_put),
        "local_fetch_s": median(local_fetch),
        "s3_put_s": median(s3_put),
        "s3_fetch_cold_s": median(s3_cold),
        "s3_fetch_warm_s": median(s3_warm),
        "serve_base_s": median(base),
        "serve_cold_s": median(cold),
        "serve_warm_s": median(warm),
        "serve_fetch_s": median(fetch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bundled", action="store_true", help="also the bundled SmolLM2-135M (converted cache needed)"
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "artweb.settings")
    import django

    django.setup()
    import torch
    from django.conf import settings

    from training.base_models import BUNDLED_MODEL, build_tiny_model

    threads = int(os.environ.get("TORCH_THREADS", "1"))
    torch.set_num_threads(threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    print(f"commit {commit.stdout.strip()}, torch threads {threads}, load average {os.getloadavg()}")
    process, endpoint = start_moto_server()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-storage-") as scratch:
            work = Path(scratch)
            tiny = build_tiny_model(work / "tiny-model", seed=0)
            rows = [measure("tiny", str(tiny), work, endpoint, work, args.repeat)]
            if args.bundled:
                rows.append(
                    measure("bundled", BUNDLED_MODEL, settings.MODEL_CACHE_DIR, endpoint, work, args.repeat)
                )
    finally:
        process.terminate()
        process.wait(timeout=10)
    for row in rows:
        mb = row["bytes"] / 1e6
        print(
            f"\n{row['checkpoint']}: checkpoint {mb:.2f} MB (adapter {row['adapter_bytes'] / 1e6:.2f} MB), "
            f"median of {args.repeat}"
        )
        print(
            f"  store   local copy+digest {row['local_put_s'] * 1000:8.1f} ms | S3 upload {row['s3_put_s'] * 1000:8.1f} ms"
            f"  ({row['s3_put_s'] / row['local_put_s']:.1f}x local, {mb / row['s3_put_s']:.0f} MB/s)"
        )
        print(
            f"  fetch   local verify      {row['local_fetch_s'] * 1000:8.1f} ms | S3 download+verify "
            f"{row['s3_fetch_cold_s'] * 1000:8.1f} ms ({mb / row['s3_fetch_cold_s']:.0f} MB/s), "
            f"cached copy verify {row['s3_fetch_warm_s'] * 1000:.1f} ms"
        )
        print(
            f"  serve   base model {row['serve_base_s'] * 1000:8.1f} ms | checkpoint cold (download+load) "
            f"{row['serve_cold_s'] * 1000:8.1f} ms | warm {row['serve_warm_s'] * 1000:8.1f} ms"
            f"  (cold/warm {row['serve_cold_s'] / row['serve_warm_s']:.1f}x)"
        )
        load = row["serve_cold_s"] - row["serve_fetch_s"] - row["serve_warm_s"]
        print(
            f"          of the cold request: download+verify {row['serve_fetch_s'] * 1000:.1f} ms, load ~{load * 1000:.0f} ms"
        )


if __name__ == "__main__":
    main()
