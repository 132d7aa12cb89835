"""What Agent RFT's tool endpoints add to a rollout step: one step's episodes (default 8 groups x 8)
driven in lockstep through ``environment.respond_batch`` (what the agent loop calls between model
turns; no model here, so only the tools' time is measured), each turn one tool call per episode, on
an ``http_tools`` environment whose endpoint is on loopback and answers after ``--latency-ms``.
Reference, interleaved step by step: the same episodes with an in-process Python tool (the same
runner and threads, no HTTP).

    .venv/bin/python -m benchmarks.http_tools_latency [--episodes 64] [--turns 3] [--latency-ms 0]
                                                      [--steps 10] [--json out.json]

Prints per call the mean latency an episode records (``tool_latency_mean_s``), and per rollout step
the wall time its tool turns took (``tool_wait_s``, summed over turns) for both. A script, not a
timed test: timings on shared machines are too noisy to assert on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks._loopback import LoopbackServer, json_endpoint
from training.environments import EnvironmentSpec, build_environment
from training.rollouts.tools import Tool, ToolCall
from training.safety.outbound import OutboundPolicy

PARAMETERS = {"type": "object", "properties": {"sku": {"type": "string"}}}


def _server(latency_s: float) -> LoopbackServer:
    """The team's tool: a stock lookup."""
    return json_endpoint(
        lambda _path, body: {"output": {"sku": body["arguments"].get("sku"), "stock": 3}}, latency_s=latency_s
    )


def _step(environment: Any, episodes: int, turns: int) -> tuple[float, list[float]]:
    """One rollout step's tool turns: wall seconds, and each episode's mean call latency (HTTP only)."""
    states = [environment.start({"prompt": "Stock?", "item": {"sku": f"A-{i}"}}) for i in range(episodes)]
    started = time.monotonic()
    for turn in range(1, turns + 1):
        calls = [[ToolCall(f"call_{turn}_0", "lookup", {"sku": "A-1"}, '{"sku": "A-1"}')] for _ in states]
        environment.respond_batch(states, [""] * episodes, calls)
    return time.monotonic() - started, [s.metrics.get("tool_latency_mean_s", 0.0) for s in states]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    server = _server(args.latency_ms / 1000)
    url = f"http://127.0.0.1:{server.server_address[1]}/lookup"
    http_tools = build_environment(
        "http_tools",
        config={"tools": [{"name": "lookup", "server_url": url, "parameters": PARAMETERS}]},
        max_turns=args.turns + 1,
        outbound=OutboundPolicy(allow=("127.0.0.1",)),
    )
    in_process = EnvironmentSpec(
        max_turns=args.turns + 1,
        tools=[Tool("lookup", "", PARAMETERS, lambda sku: {"sku": sku, "stock": 3})],
    )
    http_steps: list[float] = []
    local_steps: list[float] = []
    call_latencies: list[float] = []
    _step(http_tools, args.episodes, 1)  # warm up: threads, the first connections
    for _ in range(args.steps):
        seconds, latencies = _step(http_tools, args.episodes, args.turns)
        http_steps.append(seconds)
        call_latencies += latencies
        local_steps.append(_step(in_process, args.episodes, args.turns)[0])
    server.shutdown()
    calls = args.episodes * args.turns
    result = {
        "episodes": args.episodes,
        "turns": args.turns,
        "endpoint_latency_ms": args.latency_ms,
        "http_call_ms_mean": 1000 * statistics.mean(call_latencies),
        "http_step_ms_median": 1000 * statistics.median(http_steps),
        "in_process_step_ms_median": 1000 * statistics.median(local_steps),
        "added_per_step_ms": 1000 * (statistics.median(http_steps) - statistics.median(local_steps)),
        "added_per_call_ms": 1000 * (statistics.median(http_steps) - statistics.median(local_steps)) / calls,
    }
    print(
        f"{args.episodes} episodes x {args.turns} turns ({calls} calls/step), endpoint latency {args.latency_ms:g} ms:\n"
        f"  one call, as an episode records it: {result['http_call_ms_mean']:.1f} ms\n"
        f"  a step's tool turns: {result['http_step_ms_median']:.0f} ms over HTTP, "
        f"{result['in_process_step_ms_median']:.0f} ms in-process\n"
        f"  added by the endpoints: {result['added_per_step_ms']:.0f} ms per step "
        f"({result['added_per_call_ms']:.2f} ms per call)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
