"""Gateway benchmark: the overhead the gateway adds, and what batching buys on the inference server.

A script, not a timed test (CPU timings on shared machines are too noisy to assert on). It starts
the real processes on a scratch data dir: `manage.py serve_inference` (the CPU engine) and the web
app under uvicorn, with a team, an API key and the base model registered, then measures:

1. gateway overhead: a 1-token completion (temperature 0) sent directly to the inference server
   and through the gateway, alternately, over keep-alive connections; median and p95 of each and
   the median of the paired differences. Goal: < 5 ms added at the median.
2. batching: 16 concurrent clients against the same requests sent one at a time (through the
   gateway); completion tokens per second of each and their ratio, with the server's own batch
   statistics. Goal: >= 3x on the bundled model.
3. with ``--capture-requests N``: stored completions' cost, 16 concurrent clients each sending N
   8-token requests through the gateway, alternately ``store: true`` and ``store: false``; median
   and p95 latency of each kind and their ratio, and the rows written.

    python -m benchmarks.bench_gateway                       # bundled SmolLM2-135M (CPU, fp32)
    python -m benchmarks.bench_gateway --tiny --json /tmp/gateway-bench.json
    python -m benchmarks.bench_gateway --tiny --echo-upstream   # the gateway's own cost only

`--echo-upstream` puts the vLLM protocol double (tests/projects/gateway/fake_vllm.py, started through
`serve_inference --engine vllm --vllm-command`) behind the gateway instead of a model: it answers
in well under a millisecond, so the paired difference is the gateway's own work (its vLLM path,
which also re-serialises the body) without the model's latency noise. Only part 1 runs then.

The database is SQLite in the scratch dir unless --database-url names one (e.g. the PostgreSQL
the tests use); the gateway's per-request database work differs between the two.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import http.client
import json
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_MODEL_NAME = "bench-base"
SERVER_TOKEN = "bench-server-token"
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of the bundled one")
    parser.add_argument("--model", default="", help="a local model directory (default: the bundled model)")
    parser.add_argument("--database-url", default="", help="default: SQLite in the scratch data dir")
    parser.add_argument("--data-dir", default="", help="scratch data dir (default: a new temporary one)")
    parser.add_argument("--overhead-requests", type=int, default=200, help="pairs of 1-token requests")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32, help="completion length in the batching part")
    parser.add_argument("--batch-window-ms", type=float, default=10.0)
    parser.add_argument("--capture-requests", type=int, default=0,
                        help="part 3: this many requests per client at --clients concurrency, alternately "
                             "stored and not (store: true/false), for the latency stored completions add")  # fmt: skip
    parser.add_argument("--json", default="", help="also write the report here")
    parser.add_argument("--gateway-app", default="artweb.asgi:application",
                        help="the ASGI app uvicorn serves as the gateway (to compare variants)")  # fmt: skip
    parser.add_argument("--echo-upstream", action="store_true",
                        help="measure overhead against the vLLM protocol double instead of a model")  # fmt: skip
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Processes:
    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env, self.log_dir, self.running = env, log_dir, []

    def start(self, name: str, command: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as handle:
            process = subprocess.Popen(command, cwd=REPO_ROOT, env=self.env, stdout=handle,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.running.append(process)
        return process, log

    def stop(self) -> None:
        for process in self.running:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def wait_until(predicate, what: str, process: subprocess.Popen, log: Path, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process.poll() is not None:
            raise SystemExit(f"{what} exited:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


class Client:
    """One keep-alive HTTP connection: the cheapest client, so differences are the servers'."""

    def __init__(self, url: str, key: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=600)
        self.headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        self.connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=self.headers)
        response = self.connection.getresponse()
        payload = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {payload}")
        return payload

    def get(self, path: str) -> dict[str, Any]:
        self.connection.request("GET", path, headers=self.headers)
        return json.loads(self.connection.getresponse().read())


def gateway_routes(gateway_url: str, key: str, model: str = BASE_MODEL_NAME) -> bool:
    """Whether the gateway answers with ``key`` and routes a one-token completion of base model
    ``model`` to a registered server."""
    request = urllib.request.Request(f"{gateway_url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5):
            pass
        Client(gateway_url, key).complete({"model": model, "messages": MESSAGES, "max_tokens": 1})
        return True
    except (OSError, RuntimeError):
        return False


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ms(value: float) -> float:
    return round(value * 1000, 2)


def measure_overhead(direct: Client, gateway: Client, requests: int) -> dict[str, Any]:
    body = {"model": BASE_MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    for _ in range(10):  # warm up both paths (connections, first-request work)
        direct.complete(body)
        gateway.complete(body)
    direct_s, gateway_s = [], []
    for _ in range(requests):  # alternate, so both see the same machine load
        started = time.perf_counter()
        direct.complete(body)
        direct_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        gateway.complete(body)
        gateway_s.append(time.perf_counter() - started)
    added = [g - d for g, d in zip(gateway_s, direct_s, strict=True)]
    return {
        "requests": requests,
        "direct_ms": {"median": ms(statistics.median(direct_s)), "p95": ms(percentile(direct_s, 0.95))},
        "gateway_ms": {"median": ms(statistics.median(gateway_s)), "p95": ms(percentile(gateway_s, 0.95))},
        "added_ms": {
            "median_of_medians": ms(statistics.median(gateway_s) - statistics.median(direct_s)),
            "median_paired": ms(statistics.median(added)),
            "p95_paired": ms(percentile(added, 0.95)),
        },
    }


def measure_batching(url: str, key: str, server: Client, args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": BASE_MODEL_NAME, "messages": MESSAGES, "max_tokens": args.max_tokens, "temperature": 1.0}
    total = args.clients * args.requests_per_client

    def run_one_at_a_time() -> tuple[float, int]:
        client = Client(url, key)
        started = time.perf_counter()
        tokens = sum(client.complete(body)["usage"]["completion_tokens"] for _ in range(total))
        return time.perf_counter() - started, tokens

    def run_concurrently() -> tuple[float, int]:
        clients = [Client(url, key) for _ in range(args.clients)]
        counts = [0] * args.clients
        barrier = threading.Barrier(args.clients + 1)

        def work(index: int) -> None:
            barrier.wait()
            for _ in range(args.requests_per_client):
                counts[index] += clients[index].complete(body)["usage"]["completion_tokens"]

        threads = [threading.Thread(target=work, args=(i,)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        barrier.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started, sum(counts)

    Client(url, key).complete(body)  # warm-up
    sequential_s, sequential_tokens = run_one_at_a_time()
    before = server.get("/stats")
    concurrent_s, concurrent_tokens = run_concurrently()
    after = server.get("/stats")
    batches = after["batches"] - before["batches"]
    sequential_rate = sequential_tokens / sequential_s
    concurrent_rate = concurrent_tokens / concurrent_s
    return {
        "clients": args.clients,
        "requests": total,
        "max_tokens": args.max_tokens,
        "one_at_a_time": {
            "seconds": round(sequential_s, 2),
            "completion_tokens": sequential_tokens,
            "tokens_per_s": round(sequential_rate, 1),
        },  # fmt: skip
        "concurrent": {
            "seconds": round(concurrent_s, 2),
            "completion_tokens": concurrent_tokens,
            "tokens_per_s": round(concurrent_rate, 1),
        },  # fmt: skip
        "throughput_ratio": round(concurrent_rate / sequential_rate, 2),
        "server_batches": batches,
        "server_requests_per_batch": [b["requests"] for b in after["recent_batches"][-batches:]]
        if batches
        else [],
    }


def measure_capture(url: str, key: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--clients`` concurrent clients, each alternating a stored and an unstored request (the
    team stores those sent with ``store: true``), so both kinds see the same load."""
    from projects.models import StoredCompletion

    before = StoredCompletion.objects.count()
    body = {"model": BASE_MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "temperature": 1.0}
    latencies: dict[bool, list[float]] = {True: [], False: []}
    lock = threading.Lock()
    barrier = threading.Barrier(args.clients)

    def work(index: int) -> None:
        client = Client(url, key)
        client.complete({**body, "store": False})  # warm the connection
        barrier.wait()
        for number in range(args.capture_requests):
            stored = (number + index) % 2 == 0
            started = time.perf_counter()
            client.complete({**body, "store": stored, "metadata": {"client": str(index)}})
            with lock:
                latencies[stored].append(time.perf_counter() - started)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = len(latencies[True])
    deadline = time.monotonic() + 30
    while StoredCompletion.objects.count() - before < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    report = {"clients": args.clients, "requests": expected + len(latencies[False]),
              "rows_stored": StoredCompletion.objects.count() - before, "rows_expected": expected}  # fmt: skip
    for stored, values in latencies.items():
        report["stored" if stored else "unstored"] = {
            "median_ms": ms(statistics.median(values)), "p95_ms": ms(percentile(values, 0.95)),
        }  # fmt: skip
    report["median_ratio"] = round(report["stored"]["median_ms"] / report["unstored"]["median_ms"], 3)
    report["p95_ratio"] = round(report["stored"]["p95_ms"] / report["unstored"]["p95_ms"], 3)
    return report


def bench_environment(data_dir: Path, database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a benchmark's processes (scratch data dir, SQLite unless
    ``database_url``, no broker), applied to this process too, with Django set up in it."""
    env = {
        **os.environ,
        "ARTWEB_DATA_DIR": str(data_dir),
        "DEBUG": "1",
        "INFERENCE_SERVER_TOKEN": SERVER_TOKEN,
        "GATEWAY_RATE_LIMIT_PER_MINUTE": "0",
        "DJANGO_SETTINGS_MODULE": "artweb.settings",
        **extra,
    }
    env.pop("CELERY_BROKER_URL", None)
    env.pop("DATABASE_URL", None)
    if database_url:
        env["DATABASE_URL"] = database_url
    os.environ.update(env)
    if not database_url:
        os.environ.pop("DATABASE_URL", None)

    import django

    django.setup()
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="artweb-gateway-bench-"))
    env = bench_environment(data_dir, args.database_url, INFERENCE_BATCH_WINDOW_MS=str(args.batch_window_ms))
    from django.core.management import call_command

    from projects import services
    from projects.models import Team
    from training.base_models import BUNDLED_MODEL, build_tiny_model

    source = args.model or BUNDLED_MODEL
    if args.tiny:
        source = str(build_tiny_model(data_dir / "tiny-model"))
    call_command("migrate", interactive=False, verbosity=0)
    services.base_model_register(name=BASE_MODEL_NAME, source=source)
    team = Team.objects.filter(name="bench").first() or services.team_create(name="bench")
    key = services.api_key_create(team=team, name="bench").plaintext

    processes = Processes(env, data_dir)
    try:
        command = [
            sys.executable,
            "manage.py",
            "serve_inference",
            "--base-model",
            BASE_MODEL_NAME,
            "--port",
            "0",
        ]
        if args.echo_upstream:
            double = REPO_ROOT / "tests" / "projects" / "gateway" / "fake_vllm.py"
            command += ["--engine", "vllm", "--vllm-command", f"{sys.executable} {double}"]
        server, server_log = processes.start("inference", command)

        def server_url() -> str | None:
            for line in server_log.read_text(errors="replace").splitlines():
                if line.startswith("inference server for "):
                    return line.rsplit(" on ", 1)[1].strip()
            return None

        direct_url = wait_until(server_url, "the inference server", server, server_log)
        port = free_port()
        gateway_url = f"http://127.0.0.1:{port}"
        web, web_log = processes.start(
            "gateway",
            [
                sys.executable,
                "-m",
                "uvicorn",
                args.gateway_app,
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],  # fmt: skip
        )

        wait_until(lambda: gateway_routes(gateway_url, key), "the gateway (and the server's registration)",
                   web, web_log)  # fmt: skip
        direct = Client(direct_url, SERVER_TOKEN)
        report = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
            "model": source,
            "database": "postgresql" if args.database_url else "sqlite",
            "batch_window_ms": args.batch_window_ms,
            "upstream": "vLLM protocol double (echo)"
            if args.echo_upstream
            else "serve_inference (CPU engine)",
            "overhead": measure_overhead(direct, Client(gateway_url, key), args.overhead_requests),
        }
        if not args.echo_upstream:
            report["batching"] = measure_batching(gateway_url, key, direct, args)
        if args.capture_requests:
            services.completion_storage_set(team=team, storage="requested")
            time.sleep(2)  # the gateway remembers the key's team for GATEWAY_LOOKUP_CACHE_S
            report["capture"] = measure_capture(gateway_url, key, args)
        report["machine"]["load_avg_after"] = os.getloadavg()
    finally:
        processes.stop()

    overhead = report["overhead"]
    print(f"== gateway overhead ({overhead['requests']} alternating 1-token requests, {report['database']}, "
          f"upstream: {report['upstream']})")  # fmt: skip
    print(f"direct   median {overhead['direct_ms']['median']} ms  p95 {overhead['direct_ms']['p95']} ms")
    print(f"gateway  median {overhead['gateway_ms']['median']} ms  p95 {overhead['gateway_ms']['p95']} ms")
    print(
        f"added    median {overhead['added_ms']['median_paired']} ms (paired)  p95 {overhead['added_ms']['p95_paired']} ms"
    )
    batching = report.get("batching")
    if batching:
        print(f"== batching ({batching['clients']} clients, {batching['requests']} requests of "
              f"{batching['max_tokens']} tokens)")  # fmt: skip
        print(f"one at a time {batching['one_at_a_time']['tokens_per_s']} tok/s, "
              f"concurrent {batching['concurrent']['tokens_per_s']} tok/s: ratio {batching['throughput_ratio']}x")  # fmt: skip
        print(f"server batches (requests each): {batching['server_requests_per_batch']}")
    capture = report.get("capture")
    if capture:
        print(f"== stored completions ({capture['clients']} clients, {capture['requests']} requests, "
              f"{capture['rows_stored']}/{capture['rows_expected']} rows stored)")  # fmt: skip
        for kind in ("unstored", "stored"):
            print(f"{kind:9} median {capture[kind]['median_ms']} ms  p95 {capture[kind]['p95_ms']} ms")
        print(f"stored/unstored: median {capture['median_ratio']}x  p95 {capture['p95_ratio']}x")
    print(
        f"load average before/after: {report['machine']['load_avg']} / {report['machine']['load_avg_after']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
