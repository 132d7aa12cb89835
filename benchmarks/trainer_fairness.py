"""Another team's ``forward_backward`` latency while one team samples at its limits, on one trainer
service (training.hosting.service) in this process, on the bundled model (or ``--tiny``).

    .venv/bin/python -m benchmarks.trainer_fairness --threads 2

Two sessions of two teams on one base: team A samples (``--samples`` prompts of ``--prompt-tokens``
tokens, ``--max-tokens`` new tokens each, temperature 1) in a loop from ``--samplers`` threads, while
team B runs ``forward_backward`` (one datum of ``--datum-tokens`` tokens, cross-entropy) ``--repeats``
times. B's latency is measured three ways: alone; under A's load as before issue 51 (the lock held
for a whole sample: ``sample_slice_steps`` 0); and under load as now (the fair lock taken
``--slice-steps`` decode steps at a time). Printed: median and max seconds of each, and the ratios
to "alone". The old service held a plain ``threading.Lock``, which a sampling loop may take again
before the waiting thread wakes: the "before" side here (a fair lock held per sample) is, if
anything, kinder to B than the old code was.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._model import add_model_arguments, prepared_model
from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.hosting.pool import SessionPool
from training.hosting.service import ServiceConfig, TrainerService


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(parser)
    parser.add_argument("--samples", type=int, default=16, help="prompts per sample request (num_samples)")
    parser.add_argument("--max-tokens", type=int, default=400, help="new tokens per sample")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--samplers", type=int, default=1, help="team A's sample requests running at once")
    parser.add_argument("--datum-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slice-steps", type=int, default=ServiceConfig(root=Path(".")).sample_slice_steps)
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)
    root = Path(tempfile.mkdtemp(prefix="trainer-fairness-"))
    pool = SessionPool(lambda s: load_base_model(s, cache), spill_dir=root / "spill")
    service = TrainerService(pool, ServiceConfig(root=root, max_lease_s=10**6))
    for team in ("sampler", "trainer"):
        service.handle("POST", "/sessions", {"session_id": team, "holder": team, "base_model": source,
                                             "lease_s": 10**5, "config": TrainConfig(seed=1).to_dict(),
                                             "lora": LoraSpec().to_dict()})  # fmt: skip
    with pool.use("trainer") as session:
        vocabulary = session.vocabulary
    draw = random.Random(0)
    tokens = [draw.randrange(100, vocabulary) for _ in range(args.datum_tokens + 1)]
    fb = {"holder": "trainer", "loss_fn": "cross_entropy",
          "data": [{"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:]}}]}  # fmt: skip
    prompts = [
        [draw.randrange(100, vocabulary) for _ in range(args.prompt_tokens)] for _ in range(args.samples)
    ]
    sample = {"holder": "sampler", "prompts": prompts,
              "sampling": {"max_new_tokens": args.max_tokens, "temperature": 1.0, "stop_token_ids": []}}  # fmt: skip
    service.handle("POST", "/sessions/trainer/forward_backward", fb)  # warm-up, outside the timings

    def latencies(slice_steps: int | None) -> tuple[list[float], list[float]]:
        """B's forward_backward seconds with A sampling (None: A idle), and A's sample seconds."""
        stop, samples = threading.Event(), []  # samples: A's sample seconds
        if slice_steps is not None:
            service.config.sample_slice_steps = slice_steps

        # A thread per request A runs at once, each on a session of its own (a session's own
        # requests run one after another).
        threads = []
        for index in range(args.samplers if slice_steps is not None else 0):
            session_id = "sampler" if index == 0 else f"sampler-{index}"
            if session_id not in pool:
                service.handle("POST", "/sessions", {"session_id": session_id, "holder": "sampler",
                                                     "base_model": source, "lease_s": 10**5,
                                                     "config": TrainConfig(seed=1).to_dict(),
                                                     "lora": LoraSpec().to_dict()})  # fmt: skip
            body = dict(sample)

            def run(session_id: str = session_id, body: dict[str, Any] = body) -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    service.handle("POST", f"/sessions/{session_id}/sample", body)
                    samples.append(time.monotonic() - started)

            threads.append(threading.Thread(target=run, daemon=True))
        for thread in threads:
            thread.start()
        if threads:
            time.sleep(0.5)  # A's first sample is decoding
        times = []
        for _ in range(args.repeats):
            started = time.monotonic()
            service.handle("POST", "/sessions/trainer/forward_backward", fb)
            times.append(time.monotonic() - started)
        stop.set()
        for thread in threads:
            thread.join()
        return times, samples

    alone, _ = latencies(None)
    before, before_samples = latencies(0)
    after, after_samples = latencies(args.slice_steps)
    report: dict[str, Any] = {}
    for name, times in (("alone", alone), ("before", before), ("after", after)):
        report[f"{name}_median_s"] = statistics.median(times)
        report[f"{name}_max_s"] = max(times)
    for name in ("before", "after"):
        report[f"{name}_median_ratio"] = report[f"{name}_median_s"] / report["alone_median_s"]
        report[f"{name}_max_ratio"] = report[f"{name}_max_s"] / report["alone_median_s"]
    report["sample_s_before"] = statistics.median(before_samples) if before_samples else float("nan")
    report["sample_s_after"] = statistics.median(after_samples) if after_samples else float("nan")
    print(f"model {source}, threads {args.threads}; team A: {args.samplers} x {args.samples} prompts x "
          f"{args.prompt_tokens} tokens, {args.max_tokens} new tokens; team B: forward_backward of "
          f"{args.datum_tokens} tokens x {args.repeats}; slice {args.slice_steps} decode steps")  # fmt: skip
    print(f"{'':28}{'median s':>10}{'max s':>10}{'median x':>10}{'max x':>10}")
    for name, label in (("alone", "B alone"), ("before", "B under A, lock per sample"),
                        ("after", "B under A, lock per slice")):  # fmt: skip
        ratio = (f"{report[f'{name}_median_ratio']:>10.1f}{report[f'{name}_max_ratio']:>10.1f}"
                 if name != "alone" else f"{1.0:>10.1f}{report['alone_max_s'] / report['alone_median_s']:>10.1f}")  # fmt: skip
        print(f"{label:28}{report[f'{name}_median_s']:>10.3f}{report[f'{name}_max_s']:>10.3f}{ratio}")
    print(
        f"A's sample (median s): {report['sample_s_before']:.2f} before, {report['sample_s_after']:.2f} after"
    )
    return report


if __name__ == "__main__":
    main()
