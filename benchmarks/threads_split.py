"""Two torch processes on one host, as ``manage.py up`` runs them (a training worker and an
inference server): which thread count and OpenMP wait policy each should get.

    .venv/bin/python -m benchmarks.threads_split --repeats 3

Each configuration starts two child processes at once, with ``torch.set_num_threads(threads)``
and ``OMP_WAIT_POLICY`` set in their environment before torch loads (libgomp reads it at start):

- "train": forward + backward of a 4-layer MLP of SmolLM2-135M's widths (576 -> 1536 -> 576) on
  [256, 576] rows, like the update's matmuls;
- "decode": forward of the same MLP on [8, 576] rows, many times, like a batch-8 decode step.

Each child imports torch and builds its model, then both start a fixed amount of work together
and report its wall time; a configuration's figure is the slower of the two (until both
finished). CPU s is the two children's process time over their work: what the work cost the
machine, which on a contended machine says more than wall time (a process with more threads also
takes a larger share of the cores from everyone else's processes). The configurations run
interleaved, ``--repeats`` rounds; medians are printed with the ratio to the best one, and the
load average (other processes on the machine count against every configuration alike, which is
why only ratios of one run mean much).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import torch
threads, kind, work = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
layers = [torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576)] * 2
model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.SiLU())])
rows = 256 if kind == "train" else 8
x = torch.randn(rows, 576)
iterations = int((40 if kind == "train" else 1500) * work)
print("ready", flush=True)
sys.stdin.readline()  # both children start their work together
start, cpu = time.perf_counter(), time.process_time()
for _ in range(iterations):
    if kind == "train":
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
    else:
        with torch.no_grad():
            model(x)
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": time.process_time() - cpu}))
"""


def run_pair(threads: int, policy: str | None, work: float, kinds: tuple[str, ...]) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(threads), kind, str(work)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for kind in kinds
    ]
    for child in children:  # torch imported and the model built: not timed
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    seconds = {}
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    for kind, child in zip(kinds, children, strict=True):
        out, _ = child.communicate()
        report = json.loads(out)
        seconds[kind] = report["seconds"]
        seconds[f"{kind} cpu"] = report["cpu"]
    seconds["both"] = max(seconds[kind] for kind in kinds)
    seconds["cpu"] = sum(seconds[f"{kind} cpu"] for kind in kinds)
    return seconds


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=float, default=1.0, help="scales each child's iterations")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    configs = [(t, p) for t in sorted({1, max(cores // 2, 1), cores}) for p in (None, "PASSIVE", "ACTIVE")]
    print(f"{cores} cores; load average at start {load()}")
    times: dict[tuple[int, str | None], list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for threads, policy in configs:
            times[(threads, policy)].append(run_pair(threads, policy, args.work, ("train", "decode")))
    medians = {c: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for c, runs in times.items()}
    best = min(m["both"] for m in medians.values())
    print(
        f"{'threads/process':>15} {'OMP_WAIT_POLICY':>16} {'train s':>8} {'decode s':>9} {'both s':>7} {'÷ best':>7} "
        f"{'CPU s (both)':>13}"
    )
    for (threads, policy), m in medians.items():
        print(
            f"{threads:>15} {policy or '(unset)':>16} {m['train']:>8.2f} {m['decode']:>9.2f} "
            f"{m['both']:>7.2f} {m['both'] / best:>6.2f}x {m['cpu']:>13.2f}"
        )
    print(f"load average at end {load()}")


if __name__ == "__main__":
    main()
