"""How many stored completions per second the database takes (projects.services.completions):
the gateway writes one row per stored completion on its database threads after the reply.

A script, not a timed test. Rows are a realistic stored completion (a 3-message request, a
200-token prompt, a 64-token reply with its ids and logprobs, metadata), written one at a time
by 1 thread and by 4 threads at once (the gateway's DB_THREADS), on SQLite (a file in a scratch
folder, as the embedded default runs) and on PostgreSQL when --database-url names one, in the
same run, and the ratio of the two.

    python -m benchmarks.stored_completions --database-url postgres://postgres@127.0.0.1:5432/artweb_bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def row(team_id: int, number: int) -> dict:
    return {
        "team_id": team_id, "completion_id": f"chatcmpl-bench{number}-{time.monotonic_ns()}", "api_key_id": None,
        "model": "support/agent:prod", "served_by": "support/agent:12", "checkpoint_id": None, "stream": False,
        "metadata": {"conversation_id": f"c-{number // 4}", "customer": "acme", "channel": "chat"},
        "conversation_id": f"c-{number // 4}",
        "request": {"messages": [{"role": "system", "content": "You answer support questions. " * 8},
                                 {"role": "user", "content": "My order has not arrived, what can I do? " * 3},
                                 {"role": "assistant", "content": "Let me check."}], "temperature": 0.7},
        "response": {"id": "x", "object": "chat.completion", "created": 0, "model": "support/agent:prod",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 64},
                                  "finish_reason": "stop", "logprobs": None}],
                     "usage": {"prompt_tokens": 200, "completion_tokens": 64, "total_tokens": 264}},
        "prompt_token_ids": list(range(1000, 1200)), "token_ids": [list(range(64))],
        "logprobs": [[-0.123456 - i / 1000 for i in range(64)]], "latency_ms": 120,
    }  # fmt: skip


def measure(database_url: str, rows: int) -> dict:
    """In a child process per database, so each has its own Django settings."""
    if database_url == "sqlite":
        scratch = tempfile.mkdtemp(prefix="artweb-store-bench-")
        env = {**os.environ, "ARTWEB_DATA_DIR": scratch, "DEBUG": "1"}
        env.pop("DATABASE_URL", None)
    else:
        env = {**os.environ, "DATABASE_URL": database_url, "DEBUG": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.stored_completions", "--child", str(rows)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {database_url} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(rows: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "artweb.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    from projects import services
    from projects.models import StoredCompletion, Team

    call_command("migrate", interactive=False, verbosity=0)
    team = Team.objects.filter(name="store-bench").first() or services.team_create(name="store-bench")
    StoredCompletion.objects.filter(team=team).delete()
    report = {"database": connections["default"].vendor, "rows": rows}
    for threads in (1, 4):
        per_thread = rows // threads
        errors: list[BaseException] = []

        def work(index: int, per_thread: int = per_thread, errors: list = errors) -> None:
            try:
                for number in range(per_thread):
                    services.stored_completion_create(**row(team.pk, index * per_thread + number))
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)
            finally:
                connections.close_all()

        started = time.perf_counter()
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        elapsed = time.perf_counter() - started
        if errors:
            raise errors[0]
        report[f"threads_{threads}"] = {"rows_per_s": round(per_thread * threads / elapsed, 1),
                                        "seconds": round(elapsed, 2)}  # fmt: skip
    report["stored"] = StoredCompletion.objects.filter(team=team).count()
    StoredCompletion.objects.filter(team=team).delete()
    print(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--database-url", default="", help="PostgreSQL to compare with SQLite")
    parser.add_argument("--json", default="")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    report = {"sqlite": measure("sqlite", args.rows)}
    if args.database_url:
        report["postgresql"] = measure(args.database_url, args.rows)
    for name, result in report.items():
        print(f"{name:10} 1 thread {result['threads_1']['rows_per_s']} rows/s, "
              f"4 threads {result['threads_4']['rows_per_s']} rows/s ({result['stored']} rows written)")  # fmt: skip
    if "postgresql" in report:
        ratio = report["postgresql"]["threads_4"]["rows_per_s"] / report["sqlite"]["threads_4"]["rows_per_s"]
        print(f"PostgreSQL/SQLite at 4 threads: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
