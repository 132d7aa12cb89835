"""Two inference servers behind the gateway against one, at 16 concurrent clients.

A script, not a timed test. It starts the real processes on a scratch data dir (SQLite unless
--database-url): `manage.py serve_inference` for one base model and the gateway under uvicorn,
runs the workload (16 clients, each sending --per-client completions of --max-tokens tokens,
temperature 1, keep-alive connections) through the gateway with one server, then starts a second
server of the same base model and runs the same workload again. It prints completion tokens per
second, median and p99 latency of each, their ratios, and how many requests each server answered
(from the servers' /stats), which shows the gateway's least-outstanding spreading.

Each server runs with --server-threads torch threads (default 1). On this 2-core machine one
server at 1 thread leaves a core idle, and the second server takes it: the ratio measures what a
second server's hardware buys through the gateway, not a speed-up of the same hardware.

    python -m benchmarks.serving_spread                  # bundled SmolLM2-135M (CPU, fp32)
    python -m benchmarks.serving_spread --tiny --per-client 4
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_gateway import (
    SERVER_TOKEN,
    Client,
    Processes,
    bench_environment,
    free_port,
    gateway_routes,
    percentile,
    wait_until,
)

BASE_MODEL_NAME = "spread-base"
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of the bundled one")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=6, help="completions each client sends")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--server-threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--database-url", default="", help="default: SQLite in the scratch data dir")
    parser.add_argument("--json", default="", help="also write the report to this file")
    return parser.parse_args(argv)


def workload(url: str, key: str, clients: int, per_client: int, max_tokens: int) -> dict[str, Any]:
    latencies: list[float] = []
    tokens = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def work(index: int) -> None:
        client = Client(url, key)
        for _ in range(per_client):
            started = time.perf_counter()
            try:
                reply = client.complete({"model": BASE_MODEL_NAME, "messages": MESSAGES,
                                         "max_tokens": max_tokens, "temperature": 1.0})  # fmt: skip
            except Exception as exc:  # counted and printed: a failed request is a finding
                with lock:
                    errors.append(str(exc)[:200])
                continue
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens[0] += reply["usage"]["completion_tokens"]

    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {
        "requests": len(latencies),
        "errors": errors,
        "wall_s": round(wall, 2),
        "completion_tokens": tokens[0],
        "tokens_per_s": round(tokens[0] / wall, 2),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(percentile(latencies, 0.99), 3),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="artweb-spread-bench-"))
    env = bench_environment(data_dir, args.database_url, TORCH_THREADS=str(args.server_threads))
    from django.core.management import call_command

    from projects import services
    from projects.models import Team
    from training.base_models import BUNDLED_MODEL, build_tiny_model

    source = str(build_tiny_model(data_dir / "tiny-model")) if args.tiny else BUNDLED_MODEL
    call_command("migrate", interactive=False, verbosity=0)
    services.base_model_register(name=BASE_MODEL_NAME, source=source)
    team = Team.objects.filter(name="bench").first() or services.team_create(name="bench")
    key = services.api_key_create(team=team, name="bench").plaintext
    command = [sys.executable, "manage.py", "serve_inference", "--base-model", BASE_MODEL_NAME, "--port", "0"]

    processes = Processes(env, data_dir)
    servers: list[str] = []

    def start_server(name: str) -> str:
        process, log = processes.start(name, command)

        def url() -> str | None:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("inference server for "):
                    return line.rsplit(" on ", 1)[1].strip()
            return None

        return str(wait_until(url, name, process, log))

    def served() -> dict[str, int]:
        return {url: int(Client(url, SERVER_TOKEN).get("/stats")["requests"]) for url in servers}

    try:
        servers.append(start_server("inference-1"))
        port = free_port()
        gateway_url = f"http://127.0.0.1:{port}"
        web, web_log = processes.start(
            "gateway", [sys.executable, "-m", "uvicorn", "artweb.asgi:application", "--port", str(port),
                        "--log-level", "warning"],
        )  # fmt: skip

        wait_until(lambda: gateway_routes(gateway_url, key, BASE_MODEL_NAME), "the gateway", web, web_log)
        plan = (gateway_url, key, args.clients, args.per_client, args.max_tokens)
        workload(gateway_url, key, args.clients, 1, args.max_tokens)  # warm-up: both sides start warm
        before = served()
        one = workload(*plan)
        one["served"] = {url: n - before[url] for url, n in served().items()}

        servers.append(start_server("inference-2"))
        from projects.models import InferenceServer

        wait_until(
            lambda: InferenceServer.objects.filter(url=servers[1]).exists(), "registration", web, web_log
        )
        time.sleep(2)  # the gateway remembers a route for GATEWAY_LOOKUP_CACHE_S (1 s)
        workload(gateway_url, key, args.clients, 1, args.max_tokens)  # warm the new server too
        before = served()
        two = workload(*plan)
        two["served"] = {url: n - before[url] for url, n in served().items()}
    finally:
        processes.stop()

    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "model": source,
        "clients": args.clients,
        "per_client": args.per_client,
        "max_tokens": args.max_tokens,
        "server_threads": args.server_threads,
        "one_server": one,
        "two_servers": two,
        "throughput_ratio": round(two["tokens_per_s"] / one["tokens_per_s"], 2),
        "p99_ratio": round(two["p99_s"] / one["p99_s"], 2),
    }
    print(f"== {args.clients} clients x {args.per_client} completions of <= {args.max_tokens} tokens, "
          f"{args.server_threads} torch thread(s) per server, {os.cpu_count()} CPUs")  # fmt: skip
    for name in ("one_server", "two_servers"):
        side = report[name]
        print(f"{name:12s} {side['tokens_per_s']:8.1f} tok/s  p50 {side['p50_s']:.2f} s  p99 {side['p99_s']:.2f} s  "
              f"requests {side['requests']} (errors {len(side['errors'])})  per server {list(side['served'].values())}")  # fmt: skip
    print(f"two / one: throughput x{report['throughput_ratio']}, p99 x{report['p99_ratio']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
