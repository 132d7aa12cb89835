"""Rollouts overlapping training (``max_off_policy_steps``) against the synchronous loop, on the
demo run (benchmarks.demo_learning: the bundled model, the demo's task set, reward and config).

Each mode trains the same steps from the same seed in this process, one after the other; printed
per mode: wall seconds per step (the loop's ``step_seconds``, from one recorded step to the next),
the held-out reward before and after (the loop's own greedy evaluation), the mean training reward,
and each step's staleness; then the ratio of seconds per step, overlapped / synchronous.

Thread split: the synchronous loop uses all ``--threads`` torch threads for rollouts, then for the
update; the overlapped one gives half to each (training.runs.overlap.split_threads), since both run at
once. Evaluations happen only at step 0 and at the end (``eval_interval`` 0), outside the steps.

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.overlap --steps 8 --lags 0 1

``--remote``: each lag > 0 also with its rollouts on an inference server process of the same model
(``rollouts_on: inference_servers``; training.serving.standalone, started here with ``--threads``
/ 2 torch threads, the run's process keeping its split: half for the update).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.demo_learning import demo_run
from training.base_models import BUNDLED_MODEL
from training.runs import overlap


@contextlib.contextmanager
def inference_server(arguments: Any) -> Iterator[Any]:
    """An inference server process of the model (training.serving.standalone) for the rollouts."""
    import subprocess
    import sys
    import tempfile

    from training.engines.remote_engine import RolloutServer

    token = "benchmark-token"
    env = {
        **os.environ,
        "INFERENCE_SERVER_TOKEN": token,
        "OMP_NUM_THREADS": str(max(1, arguments.threads // 2)),
    }
    log = Path(tempfile.mkdtemp(prefix="overlap-server-")) / "server.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "training.serving.standalone", "--model", arguments.model,
             "--cache-dir", str(arguments.cache_dir), "--adapter-root", tempfile.gettempdir(),
             "--threads", str(max(1, arguments.threads // 2))],
            stdout=output, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (
            lines := [x for x in log.read_text().splitlines() if x.startswith("inference server on ")]
        ):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the inference server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield RolloutServer(url=lines[0].split()[-1], token=token)
    finally:
        process.terminate()
        process.wait(timeout=30)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1], help="max_off_policy_steps per mode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/demo_learning/models"))
    parser.add_argument("--model", default=BUNDLED_MODEL)
    parser.add_argument(
        "--unsplit",
        action="store_true",
        help="also run each lag with all threads on both sides (no split: oversubscribed)",
    )
    parser.add_argument(
        "--remote", action="store_true", help="also each lag with rollouts on an inference server"
    )
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    report: dict[str, Any] = {"steps": arguments.steps, "seed": arguments.seed, "threads": arguments.threads,
                              "modes": {}}  # fmt: skip
    modes = [(lag, True, False) for lag in arguments.lags]
    modes += [(lag, False, False) for lag in arguments.lags if lag and arguments.unsplit]
    modes += [(lag, True, True) for lag in arguments.lags if lag and arguments.remote]
    for lag, split, remote in modes:
        started = time.monotonic()
        with contextlib.ExitStack() as patches:
            if not split:
                patches.enter_context(
                    mock.patch.object(overlap, "split_threads", lambda device: contextlib.nullcontext())
                )
            overrides = {"max_off_policy_steps": lag, "eval_interval": 0}
            server = None
            if remote:
                overrides["rollouts_on"] = "inference_servers"
                server = patches.enter_context(inference_server(arguments))
            hooks = demo_run(steps=arguments.steps, seed=arguments.seed, cache_dir=arguments.cache_dir,
                             model=arguments.model, overrides=overrides, echo=False,
                             rollout_server=server)  # fmt: skip
        seconds = [s["step_seconds"] for s in hooks.steps]
        name = f"{lag}-remote" if remote else f"{lag}" if split or not lag else f"{lag}-unsplit"
        threads = "all, one side at a time" if not lag else ("half each" if split else "all each")
        if remote:
            threads = (
                f"update: half of {arguments.threads}; inference server: {max(1, arguments.threads // 2)}"
            )
        mode = {
            "max_off_policy_steps": lag,
            "threads": threads,
            "seconds_per_step": round(statistics.fmean(seconds), 2),
            "seconds_per_step_after_first": round(statistics.fmean(seconds[1:]), 2),
            "heldout_before": hooks.evaluations[0]["reward_mean"],
            "heldout_after": hooks.evaluations[arguments.steps]["reward_mean"],
            "train_reward_mean": round(statistics.fmean(s["reward_mean"] for s in hooks.steps), 3),
            "off_policy_steps": [s.get("off_policy_steps") for s in hooks.steps],
            "wall_seconds": round(time.monotonic() - started, 1),
        }
        report["modes"][name] = mode
        print(json.dumps(mode), flush=True)
    if "0" in report["modes"]:
        sync = report["modes"]["0"]
        for name, mode in report["modes"].items():
            if name != "0":
                ratio = mode["seconds_per_step"] / sync["seconds_per_step"]
                report[f"ratio_{name}_vs_sync"] = round(ratio, 3)
                print(f"max_off_policy_steps {name} ({mode['threads']}): {mode['seconds_per_step']} s/step vs "
                      f"synchronous {sync['seconds_per_step']} s/step: ×{ratio:.2f} (held-out "
                      f"{mode['heldout_after']:.3f} vs {sync['heldout_after']:.3f})")  # fmt: skip
    if arguments.json:
        arguments.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
