"""The outbound-URL policy's added latency per request: chat completions POSTed to a local listener
alternately through a bare urllib opener (what ``training.wire.openai_http`` did before the policy) and
through the policy (``check_url`` + the pinned opener, the listener's address allow-listed), in one
run, reporting the median of the paired differences; plus the cost of the checks alone.

    .venv/bin/python -m benchmarks.bench_outbound [--requests 1000] [--host 127.0.0.1|localhost] [--json out.json]

A script, not a timed test: timings on shared machines are too noisy to assert on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from training.safety.outbound import OutboundPolicy

ANSWER = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "1"}}]}).encode()
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(ANSWER)))
        self.end_headers()
        self.wfile.write(ANSWER)

    def log_message(self, *args: Any) -> None:
        pass


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


def _post(opener: urllib.request.OpenerDirector, url: str) -> None:
    request = urllib.request.Request(
        url, data=BODY, headers={"Content-Type": "application/json"}, method="POST"
    )
    with opener.open(request, timeout=10) as response:
        response.read()


def _us(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="request pairs (bare, policy)")
    parser.add_argument("--host", default="127.0.0.1", help="how the URL names the listener")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    url = f"http://{args.host}:{port}/v1/chat/completions"
    bare = urllib.request.build_opener(_NoRedirects())
    policy = OutboundPolicy(allow=(f"{args.host}:{port}",))

    def through_policy() -> None:
        policy.check_url(url, resolve=False)  # as training.wire.openai_http does before each request
        _post(policy.opener(), url)

    for _ in range(20):  # warm-up: imports, first connections
        _post(bare, url)
        through_policy()
    bare_s: list[float] = []
    policy_s: list[float] = []
    for index in range(args.requests):
        # Alternate which goes first, so neither always meets the warmer machine.
        order = [("bare", lambda: _post(bare, url)), ("policy", through_policy)]
        for name, call in order if index % 2 == 0 else reversed(order):
            started = time.perf_counter()
            call()
            (bare_s if name == "bare" else policy_s).append(time.perf_counter() - started)
    server.shutdown()
    server.server_close()
    added = [p - b for p, b in zip(policy_s, bare_s, strict=True)]

    checks = {}
    for label, target, resolve in (
        ("check_url, no lookup", url, False),
        ("check_url with lookup", url, True),
        ("refused: http://2130706433/", "http://2130706433/", True),
    ):
        timings = []
        for _ in range(2000):
            started = time.perf_counter()
            with contextlib.suppress(ValueError):  # OutboundRefused: the refusal is what is timed
                policy.check_url(target, resolve=resolve)
            timings.append(time.perf_counter() - started)
        checks[label] = _us(timings)

    report = {
        "requests": args.requests,
        "host": args.host,
        "bare": _us(bare_s),
        "policy": _us(policy_s),
        "added": _us(added),
        "checks": checks,
    }
    print(f"== {args.requests} request pairs to a local listener named {args.host}")
    for name in ("bare", "policy", "added"):
        figures = report[name]
        print(f"{name:>8}: median {figures['median_us']:8.1f} us   p90 {figures['p90_us']:8.1f} us")
    print("== the policy's checks alone (2000 each)")
    for label, figures in checks.items():
        print(f"{label:>30}: median {figures['median_us']:7.1f} us   p90 {figures['p90_us']:7.1f} us")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
