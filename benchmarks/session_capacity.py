"""How many training sessions one host keeps resident on one copy of a base model
(training.hosting.pool), on the bundled model (or ``--tiny``).

    .venv/bin/python -m benchmarks.session_capacity --sessions 16 --threads 1

Opens ``--sessions`` sessions (LoRA r=8 / alpha=16 on the seven projections, the platform's
default), each trained one step so its gradients and AdamW moments exist, and prints the process's
resident memory (RSS) after the base model and after each batch of sessions, the pool's own count
of bytes per session, and how many sessions fit in ``--memory-gib`` (24 by default, this machine)
after the base model and ``--headroom-gib`` for activations. Against it, the same count for the
way before the pool: one base model per session (its RSS measured for one).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks._model import add_model_arguments, prepared_model
from training.base_models import load_base_model
from training.config import LoraSpec, TrainConfig
from training.hosting.pool import SessionPool
from training.session.contract import Datum

ROOT = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, default=16)
    add_model_arguments(parser)
    parser.add_argument("--memory-gib", type=float, default=24.0)
    parser.add_argument(
        "--headroom-gib", type=float, default=4.0, help="kept free for activations and the OS"
    )
    args = parser.parse_args(argv)
    cache, source = prepared_model(args)
    start = rss_mib()
    pool = SessionPool(lambda s: load_base_model(s, cache), spill_dir=Path(tempfile.mkdtemp()) / "spill")
    datum = Datum(model_input=list(range(10, 74)), loss_fn_inputs={"target_tokens": list(range(11, 75))})
    rows = []

    def step_seconds(session_id: str, repeats: int = 3) -> float:
        """Median seconds of one forward_backward + optim_step of a session already in use."""
        times = []
        for _ in range(repeats):
            started = time.monotonic()
            with pool.use(session_id) as session:
                session.forward_backward([datum], "cross_entropy")
                session.optim_step(learning_rate=1e-4)
            times.append(time.monotonic() - started)
        return sorted(times)[len(times) // 2]

    for index in range(args.sessions):
        started = time.monotonic()
        pool.open(f"team-{index}", source, TrainConfig(seed=index), LoraSpec(rank=8, alpha=16))
        with pool.use(f"team-{index}") as session:
            session.forward_backward([datum], "cross_entropy")
            session.optim_step(learning_rate=1e-4)
        rows.append((index + 1, rss_mib() - start, time.monotonic() - started))
        if index == 0:
            alone_step = step_seconds("team-0")
    crowded_step = step_seconds("team-0")
    per_session_counted = pool.resident_bytes() / args.sessions / 2**20
    first_total = rows[0][1]
    per_session_rss = (rows[-1][1] - first_total) / max(args.sessions - 1, 1)
    for count, mib, seconds in rows:
        if count in (1, 2, 4, 8, 16, 32, 64) or count == args.sessions:
            print(f"sessions {count:3d}: RSS above start {mib:8.1f} MiB (last open + step {seconds:.2f} s)")
    budget = (args.memory_gib - args.headroom_gib) * 1024
    base_only = first_total - per_session_counted
    fit_pool = int((budget - base_only) / max(per_session_rss, per_session_counted))
    fit_separate = int(budget / first_total)
    print(f"one step of a session: {alone_step:.3f} s with 1 resident, {crowded_step:.3f} s with "
          f"{args.sessions} resident (x{crowded_step / alone_step:.2f})")  # fmt: skip
    print(
        f"per session: {per_session_rss:.1f} MiB RSS growth, {per_session_counted:.1f} MiB by the pool's count"
    )
    print(f"base model + first session: {first_total:.1f} MiB; base model ~ {base_only:.1f} MiB")
    print(f"in {args.memory_gib:g} GiB less {args.headroom_gib:g} GiB headroom: {fit_pool} sessions on one base, "
          f"{fit_separate} with a base model each; ratio {fit_pool / max(fit_separate, 1):.1f}x")  # fmt: skip
    return {"per_session_mib": max(per_session_rss, per_session_counted), "sessions_on_one_base": fit_pool,
            "sessions_with_own_base": fit_separate, "base_mib": base_only,
            "step_ratio_crowded": crowded_step / alone_step}  # fmt: skip


if __name__ == "__main__":
    main()
