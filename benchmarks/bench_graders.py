"""Grader throughput: the python grader's sandbox (start-up, warm samples per second) against the
in-process string_check. A script, not a timed test: timings on shared machines are too noisy to
assert on.

    .venv/bin/python -m benchmarks.bench_graders [--samples 500] [--starts 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from training.rewards import Sample, SandboxConfig, build_grader, grade_many, sandbox_mode
from training.rewards.sandbox import PythonSandbox

PYTHON_SOURCE = """
import re

def grade(sample, item):
    numbers = re.findall(r"-?\\d+", sample["output_text"])
    return 1.0 if numbers and numbers[-1] == str(item["answer"]) else 0.0
"""
STRING_CHECK = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "like",
}


def samples(count: int) -> tuple[list[Sample], list[dict]]:
    outputs = [Sample(output_text=f"Adding them up, the answer is {n % 97}.") for n in range(count)]
    return outputs, [{"answer": n % 89} for n in range(count)]


def sandbox_start_seconds(starts: int) -> list[float]:
    """Time from nothing to the first grade returned, minus one warm grade: the start-up alone."""
    timings = []
    for _ in range(starts):
        with PythonSandbox(PYTHON_SOURCE) as sandbox:
            started = time.perf_counter()
            sandbox.grade({"output_text": "1"}, {"answer": 1})
            first = time.perf_counter() - started
            started = time.perf_counter()
            sandbox.grade({"output_text": "1"}, {"answer": 1})
            timings.append(first - (time.perf_counter() - started))
    return timings


def per_second(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500, help="samples per throughput measurement")
    parser.add_argument("--starts", type=int, default=10, help="sandbox start-ups to time")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    figures: dict[str, float | str] = {"sandbox_mode": sandbox_mode(SandboxConfig())}
    starts = sandbox_start_seconds(args.starts)
    figures["sandbox_start_ms_median"] = 1000 * statistics.median(starts)
    figures["sandbox_start_ms_max"] = 1000 * max(starts)

    batch, items = samples(args.samples)
    python = build_grader({"type": "python", "source": PYTHON_SOURCE})
    started = time.perf_counter()
    results = grade_many(python, batch, items)  # one sandbox for the batch: one start-up included
    figures["python_samples_per_second_batch_incl_start"] = per_second(
        len(batch), time.perf_counter() - started
    )
    assert all(not result.errors for result in results), results[0].errors
    with PythonSandbox(PYTHON_SOURCE) as sandbox:
        sandbox.grade({"output_text": "0"}, {"answer": 0})  # warm
        started = time.perf_counter()
        for sample, item in zip(batch, items, strict=True):
            sandbox.grade(sample.to_grader_dict(), item)
        figures["python_samples_per_second_warm"] = per_second(len(batch), time.perf_counter() - started)

    many = max(args.samples, 20_000)
    batch, items = samples(many)
    string_check = build_grader(STRING_CHECK)
    started = time.perf_counter()
    grade_many(string_check, batch, items)
    figures["string_check_samples_per_second"] = per_second(many, time.perf_counter() - started)

    width = max(len(name) for name in figures)
    for name, value in figures.items():
        print(f"{name:<{width}}  {value:,.1f}" if isinstance(value, float) else f"{name:<{width}}  {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
