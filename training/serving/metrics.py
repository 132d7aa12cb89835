"""Prometheus series of one inference server (``GET /metrics``, behind the server's token):
requests by status, rows decoding together per step, time to first token, tokens generated, and
the LoRA adapter cache (loaded now, loads, evictions), and the disk cache of fetched checkpoints
(budget, bytes held, hits, misses, evictions: hit rate = hits / (hits + misses)). Plain prometheus_client, no Django: the
server is a bare ASGI app (training.serving.app). ``PROMETHEUS_MULTIPROC_DIR``, when set, makes
the values those of every process on the host, as for the web and the worker (projects.metrics).
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.registry import REGISTRY

REQUESTS = Counter("artweb_inference_requests_total", "Chat completion requests by HTTP status", ["status"])
BATCH_SIZE = Histogram(
    "artweb_inference_batch_size",
    "Sequences decoding together, per engine step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
TIME_TO_FIRST_TOKEN = Histogram(
    "artweb_inference_time_to_first_token_seconds",
    "From a request's arrival to its first sampled token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TOKENS = Counter("artweb_inference_tokens_total", "Completion tokens generated")
LOADED_ADAPTERS = Gauge(
    "artweb_inference_loaded_adapters", "LoRA adapters loaded in the engine now", multiprocess_mode="livesum"
)
ADAPTER_LOADS = Counter("artweb_inference_adapter_loads_total", "LoRA adapters loaded")
ADAPTER_EVICTIONS = Counter(
    "artweb_inference_adapter_evictions_total", "LoRA adapters evicted (least recently used)"
)

FETCH_CACHE_BUDGET = Gauge(
    "artweb_inference_checkpoint_cache_budget_bytes",
    "Disk budget of fetched checkpoints (0: none)",
    multiprocess_mode="livemax",
)
FETCH_CACHE_BYTES = Gauge(
    "artweb_inference_checkpoint_cache_bytes",
    "Bytes of fetched checkpoints on disk now",
    multiprocess_mode="livesum",
)
FETCH_CACHE_HITS = Counter(
    "artweb_inference_checkpoint_cache_hits_total", "Checkpoint requests served without a download"
)
FETCH_CACHE_MISSES = Counter(
    "artweb_inference_checkpoint_cache_misses_total", "Checkpoint requests that downloaded from the store"
)
FETCH_CACHE_EVICTIONS = Counter(
    "artweb_inference_checkpoint_cache_evictions_total", "Fetched checkpoints removed to keep the disk budget"
)


def exposition() -> tuple[bytes, str]:
    """The body and content type of ``GET /metrics``."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
