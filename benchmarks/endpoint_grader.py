"""Endpoint-grader throughput at 16 concurrent rollouts: one step's trajectories (default 4 groups x 4,
each a short tool-using trace) graded through ``training.rewards.grade_trajectories`` (the run loop's
grading path, training/runs/steps.py) by an ``endpoint`` grader against a loopback endpoint that
answers after ``--latency-ms``. References measured in the same run, step by step interleaved: the
same grader with ``max_concurrency`` 1 (calls in series), and a ``string_check`` on the same
trajectories (no network).

    .venv/bin/python -m benchmarks.endpoint_grader [--latency-ms 50] [--steps 20] [--json out.json]

A script, not a timed test: timings on shared machines are too noisy to assert on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks._loopback import LoopbackServer, json_endpoint
from training.rewards import grade_trajectories
from training.rollouts.trajectory import Trajectory
from training.safety.outbound import OutboundPolicy

TRACE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    {"role": "assistant", "content": "It is 21 degrees in Paris."},
]  # fmt: skip
STRING_CHECK = {"type": "string_check", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                "operation": "like"}  # fmt: skip


def _server(latency_s: float) -> LoopbackServer:
    """The team's grader: 1.0 when the reply says 21 degrees."""
    return json_endpoint(
        lambda _path, body: {"reward": 1.0 if "21" in body["sample"]["output_text"] else 0.0},
        latency_s=latency_s,
    )


def _step(groups: int, group_size: int) -> tuple[list[list[Trajectory]], list[dict[str, Any]]]:
    trajectories = [
        [Trajectory(messages=list(TRACE), prompt_token_ids=[], completion_token_ids=[], logprobs=[],
                    finish_reason="stop") for _ in range(group_size)]
        for _ in range(groups)
    ]  # fmt: skip
    rows = [{"index": index, "data": {"item": {"answer": "21"}}} for index in range(groups)]
    return trajectories, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the endpoint's time per call")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="graded steps per side")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    server = _server(args.latency_ms / 1000)
    port = server.server_address[1]
    policy = OutboundPolicy(allow=(f"127.0.0.1:{port}",))
    rollouts = args.groups * args.group_size
    endpoint = {"type": "endpoint", "url": f"http://127.0.0.1:{port}/grade", "retries": 0, "timeout_s": 30}
    sides = {
        f"endpoint, {rollouts} in flight": {**endpoint, "max_concurrency": min(rollouts, 64)},
        "endpoint, 1 in flight": {**endpoint, "max_concurrency": 1},
        "string_check (in process)": STRING_CHECK,
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(args.steps + 1):  # step 0 warms up (imports, first connections)
        for name, spec in sides.items():
            groups, rows = _step(args.groups, args.group_size)
            started = time.perf_counter()
            metrics = grade_trajectories(spec, groups, rows, 0.0, outbound=policy, context={"step": step})
            elapsed = time.perf_counter() - started
            assert metrics["grader_errors"] == 0 and all(t.reward == 1.0 for g in groups for t in g), metrics
            if step:
                seconds[name].append(elapsed)
    server.shutdown()
    report: dict[str, Any] = {
        "latency_ms": args.latency_ms,
        "rollouts_per_step": rollouts,
        "steps": args.steps,
        "sides": {
            name: {
                "median_step_s": statistics.median(values),
                "samples_per_s": rollouts / statistics.median(values),
            }
            for name, values in seconds.items()
        },
    }
    concurrent = report["sides"][f"endpoint, {rollouts} in flight"]["samples_per_s"]
    for side in report["sides"].values():
        side["concurrent_endpoint_vs_this"] = concurrent / side["samples_per_s"]
    print(
        f"{rollouts} rollouts per step, endpoint latency {args.latency_ms:g} ms, {args.steps} steps per side"
    )
    print(f"{'grader':<30} {'median step':>12} {'samples/s':>10} {'concurrent endpoint vs this':>28}")
    for name, side in report["sides"].items():
        print(
            f"{name:<30} {side['median_step_s'] * 1000:>9.1f} ms {side['samples_per_s']:>10.1f} "
            f"{side['concurrent_endpoint_vs_this']:>27.3g}x"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return report


if __name__ == "__main__":
    main()
