"""The inference server's schedulers side by side: the window scheduler (one engine call per batch;
a request that arrives while a batch decodes waits for it to end) against continuous batching
(training.serving.continuous: it joins at the next token), in one run, on one engine.

For each number of concurrent clients (1, 4, 16, 64), each scheduler in turn (the order alternates
from one level to the next) serves the same closed-loop workload: every client sends streamed chat
completions one after the other, the same prompts and the same `max_tokens` (drawn from a seeded
range, so lengths differ; `--equal-tokens`: all the same) for both schedulers. The window
scheduler batches only requests with equal sampling parameters, `max_tokens` included, so mixed
lengths also measure that; equal lengths measure only joining a running batch, which needs
arrivals that are not in step: `--stagger-s` starts each client after a seeded random delay.
Stop tokens are switched off, so every request decodes exactly its `max_tokens` under either
scheduler. Requests go through the server's ASGI application in this process (InferenceApp, the
code `serve_inference` runs) without sockets, so client and HTTP overhead stay out of the
figures. Reported per level and scheduler: p50/p99 time to first token, p50/p99 total latency,
and throughput (completion tokens / wall time); then continuous ÷ window throughput and p99
latencies at 16 clients.

    .venv/bin/python -m benchmarks.serving_batching [--model DIR] [--clients 1,4,16,64]
        [--requests-per-level 2] [--min-tokens 4] [--max-tokens 32] [--equal-tokens]
        [--stagger-s 0] [--threads 1] [--json out.json]

Without --model it runs on the bundled SmolLM2-135M-Instruct (converted into --cache-dir on first
use, ~30 s). A script, not a timed test: timings on shared machines are too noisy to assert on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

TOPICS = ["the sea", "a robot", "winter", "a city at night", "an old map", "bread", "a lighthouse", "rain"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(app: Any, body: dict[str, Any]) -> tuple[float, float, int]:
    """(time to first token, total time, completion tokens) of one streamed request."""
    data = json.dumps(body).encode()
    delivered = False
    forever = asyncio.Event()
    started = time.perf_counter()
    first: float | None = None
    completion_tokens = 0
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": data, "more_body": False}
        await forever.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal first, completion_tokens, status
        if message["type"] == "http.response.start":
            status = message["status"]
            return
        for block in message.get("body", b"").split(b"\n\n"):
            if not block.startswith(b"data: {"):
                continue
            event = json.loads(block[len(b"data: ") :])
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                if first is None and "role" not in choice["delta"]:
                    first = time.perf_counter() - started

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    await app(scope, receive, send)
    total = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"request failed with status {status}")
    return (first if first is not None else total), total, completion_tokens


def workload(clients: int, per_client: int, min_tokens: int, max_tokens: int) -> list[list[dict[str, Any]]]:
    """Each client's request bodies, the same for both schedulers."""
    rng = random.Random(clients)
    plans = []
    for client in range(clients):
        bodies = []
        for request in range(per_client):
            topic = TOPICS[(client + request) % len(TOPICS)]
            bodies.append({
                "model": "bench",
                "messages": [{"role": "user", "content": f"Write two sentences about {topic}."}],
                "max_tokens": rng.randint(min_tokens, max_tokens),
                "temperature": 1.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            })  # fmt: skip
        plans.append(bodies)
    return plans


async def measure(app: Any, plans: list[list[dict[str, Any]]], stagger_s: float) -> dict[str, Any]:
    task = asyncio.create_task(app.scheduler.run())
    try:
        await one_request(app, {**plans[0][0], "max_tokens": 2})  # warm-up
        results: list[tuple[float, float, int]] = []

        rng = random.Random(len(plans))
        delays = [rng.uniform(0, stagger_s) if stagger_s > 0 else 0.0 for _ in plans]

        async def client(bodies: list[dict[str, Any]], delay: float) -> None:
            await asyncio.sleep(delay)
            for body in bodies:
                results.append(await one_request(app, body))

        started = time.perf_counter()
        await asyncio.gather(*(client(bodies, delay) for bodies, delay in zip(plans, delays, strict=True)))
        wall = time.perf_counter() - started
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ttft = [r[0] for r in results]
    total = [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return {
        "requests": len(results),
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": round(percentile(ttft, 0.5), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "total_p50_s": round(percentile(total, 0.5), 4),
        "total_p99_s": round(percentile(total, 0.99), 4),
        "server": {key: app.stats()[key] for key in ("batches", "requests", "max_requests_in_batch")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local HF model directory (default: the bundled model)")
    parser.add_argument("--cache-dir", default="data/models", help="where the bundled model is converted")
    parser.add_argument("--clients", default="1,4,16,64", help="concurrency levels, comma-separated")
    parser.add_argument("--requests-per-level", type=int, default=2,
                        help="requests per level = this × max(clients, 4); each client sends its share in turn")  # fmt: skip
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--equal-tokens", action="store_true",
                        help="every request asks for --max-tokens (the window scheduler batches only "
                        "requests with equal max_tokens; this isolates joining a running batch)")  # fmt: skip
    parser.add_argument("--stagger-s", type=float, default=0.0,
                        help="each client starts after a seeded uniform delay in [0, this) seconds")  # fmt: skip
    parser.add_argument(
        "--max-batch-size", type=int, default=32, help="sequences per batch (both schedulers)"
    )
    parser.add_argument(
        "--window-ms", type=float, default=10.0, help="idle batching window (both schedulers)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args(argv)

    import torch

    from training.base_models import BUNDLED_MODEL, load_base_model
    from training.engines.transformers_engine import TransformersEngine
    from training.serving.app import InferenceApp, ServerConfig
    from training.serving.protocol import Limits

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_base_model(args.model or BUNDLED_MODEL, Path(args.cache_dir))
    engine = TransformersEngine(model, tokenizer)
    engine.stop_token_ids = frozenset()  # every request decodes exactly its max_tokens (see the doc)

    def app_for(scheduler: str) -> InferenceApp:
        config = ServerConfig(
            model_name="bench", adapter_root=Path(args.cache_dir), scheduler=scheduler,
            batch_window_s=args.window_ms / 1000, max_batch_size=args.max_batch_size,
            limits=Limits(max_n=args.max_batch_size, max_tokens=max(args.max_tokens, 16)),
        )  # fmt: skip
        return InferenceApp(engine, config)

    levels = [int(level) for level in args.clients.split(",")]
    report: dict[str, Any] = {
        "model": args.model or BUNDLED_MODEL,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "stagger_s": args.stagger_s,
        "max_tokens": [args.max_tokens if args.equal_tokens else args.min_tokens, args.max_tokens],
        "load_before": os.getloadavg(),
        "commit": _commit(),
        "levels": {},
    }
    started = time.perf_counter()
    for position, clients in enumerate(levels):
        per_client = max(1, args.requests_per_level * max(clients, 4) // clients)
        low = args.max_tokens if args.equal_tokens else args.min_tokens
        plans = workload(clients, per_client, low, args.max_tokens)
        order = ["window", "continuous"] if position % 2 == 0 else ["continuous", "window"]
        level: dict[str, Any] = {}
        for scheduler in order:
            level[scheduler] = asyncio.run(measure(app_for(scheduler), plans, args.stagger_s))
            figures = level[scheduler]
            print(
                f"{clients:>3} clients {scheduler:>10}: {figures['requests']:>4} requests "
                f"{figures['tokens_per_s']:>7.1f} tok/s  ttft p50 {figures['ttft_p50_s']:.3f}s "
                f"p99 {figures['ttft_p99_s']:.3f}s  total p50 {figures['total_p50_s']:.3f}s "
                f"p99 {figures['total_p99_s']:.3f}s  (server batches {figures['server']['batches']})",
                flush=True,
            )
        window, continuous = level["window"], level["continuous"]
        level["continuous_over_window"] = {
            "throughput": round(continuous["tokens_per_s"] / window["tokens_per_s"], 3),
            "ttft_p99": round(continuous["ttft_p99_s"] / window["ttft_p99_s"], 3),
            "total_p99": round(continuous["total_p99_s"] / window["total_p99_s"], 3),
        }
        report["levels"][str(clients)] = level
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["load_after"] = os.getloadavg()
    if "16" in report["levels"]:
        ratio = report["levels"]["16"]["continuous_over_window"]
        print(
            f"at 16 clients, continuous ÷ window: throughput {ratio['throughput']:.2f}×, "
            f"p99 time to first token {ratio['ttft_p99']:.2f}×, p99 total latency {ratio['total_p99']:.2f}×"
        )
    print(f"load average before {report['load_before']}, after {report['load_after']}; "
          f"torch threads {report['threads']}; {report['seconds']} s")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
