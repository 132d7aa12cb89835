"""API benchmark on PostgreSQL: the read endpoints a dashboard and CI poll, at production size.

A script, not a timed test. It creates its own database (default ``artweb_bench``, dropped at the
end unless --keep), migrates it and fills two teams ("big" and "twin") of the same size: per team
10k runs, 100k step-metric rows (10 per run) and 1M trajectory rows (100 per run: 10 steps of
2 groups x 5 samples), 100 trainable models with 10 checkpoints each; plus a reference team
("small": one model, 120 runs: a full first page) of the same shape. Rows go in with COPY (psycopg), so the build takes
minutes, not hours.

Then, through Django's test client (the whole middleware and DRF stack in this process, PostgreSQL
over TCP; no HTTP server), 200 requests per endpoint after 20 warm-ups, each at a different run or
model picked at random from the team:

    GET /api/v1/runs/                        runs list (first page, 100 runs)
    GET /api/v1/runs/{id}/metrics/           a run's step metrics
    GET /api/v1/runs/{id}/trajectories/?step=N   a step's trajectories
    GET /api/v1/models/{id}/checkpoints/     a model's checkpoint list
    GET /v1/models                           the gateway's model list (every checkpoint of the team)

It prints p50/p95 per endpoint for the big team, the same for the small reference team measured
in the same run, the ratio big ÷ small, and the number of SQL queries each request made (the same
at both sizes when there is no N+1). Goal: p95 < 50 ms at the big size.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres python -m benchmarks.api_pg
    python -m benchmarks.api_pg --runs 2000 --keep          # smaller, keep the database
    python -m benchmarks.api_pg --reuse                     # measure again on a kept database

DATABASE_URL names the server (and credentials); the benchmark's database is --database on it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
WARMUP = 20
STEPS_PER_RUN = 10
GROUPS, SAMPLES = 2, 5  # trajectories per step: GROUPS * SAMPLES
MODELS_PER_TEAM = 100
CHECKPOINTS_PER_MODEL = 10
MESSAGES = json.dumps(
    [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "What is the capital of France? Think, then answer briefly."},
        {"role": "assistant", "content": "Paris"},
    ]
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", default="artweb_bench", help="the scratch database (created, dropped)")
    parser.add_argument(
        "--runs", type=int, default=10_000, help="runs per big team (x10 metrics, x100 trajectories)"
    )
    parser.add_argument("--requests", type=int, default=200, help="measured requests per endpoint")
    parser.add_argument("--keep", action="store_true", help="keep the database at the end")
    parser.add_argument("--reuse", action="store_true", help="measure on a database kept by --keep")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    return parser.parse_args(argv)


def server_url() -> str:
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    if not url.startswith(("postgres://", "postgresql://")):
        sys.exit("DATABASE_URL must name a PostgreSQL server")
    return url


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def admin_execute(url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as connection:
        connection.execute(sql)


def database_exists(url: str, name: str) -> bool:
    import psycopg

    with psycopg.connect(with_database(url, "postgres"), autocommit=True) as connection:
        return (
            connection.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is not None
        )


def setup_django(url: str) -> None:
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "artweb.settings")
    os.environ["DEBUG"] = "0"  # DEBUG keeps every query in memory; measure what production runs
    os.environ.setdefault("SECRET_KEY", "benchmark-only-secret-key-not-used-anywhere-else-0123456789")
    os.environ.setdefault("ALLOWED_HOSTS", "testserver,localhost")
    sys.path.insert(0, str(REPO_ROOT))
    import django

    django.setup()


# --- building the data -------------------------------------------------------------------------


def _copy(model: Any, rows: list[dict[str, Any]] | Any, columns: list[str]) -> int:
    """COPY ``rows`` (dicts of ``columns``) into ``model``'s table; every other concrete column gets
    its field's default, so a field another migration adds does not break the build."""
    from django.db import connection

    fields = [f for f in model._meta.concrete_fields if not f.primary_key]
    names = [f.column for f in fields]
    defaults = {}
    for field in fields:
        if field.attname not in columns:
            value = field.get_default() if field.has_default() else None
            if value is None and not field.null and getattr(field, "auto_now_add", False):
                value = datetime.now(UTC)
            defaults[field.attname] = value
    json_columns = {f.attname for f in fields if f.get_internal_type() == "JSONField"}
    count = 0
    raw = connection.connection
    with raw.cursor() as cursor:
        quoted = ", ".join(f'"{name}"' for name in names)
        with cursor.copy(f'COPY "{model._meta.db_table}" ({quoted}) FROM STDIN') as copy:
            for row in rows:
                values = []
                for field in fields:
                    value = row[field.attname] if field.attname in row else defaults[field.attname]
                    if field.attname in json_columns and not isinstance(value, str):
                        value = json.dumps(value)
                    values.append(value)
                copy.write_row(values)
                count += 1
    return count


def build_team(name: str, runs: int, models: int, seed: int) -> dict[str, Any]:
    from django.contrib.auth import get_user_model
    from django.db import connection, transaction

    from projects import services
    from projects.models import BaseModel, Checkpoint, Run, StepMetrics, Trajectory

    rng = random.Random(seed)
    owner = get_user_model().objects.create_user(username=f"{name}-owner", password="bench-pw-123")
    team = services.team_create(name=name, owner=owner)
    key = services.api_key_create(team=team, name="bench").plaintext
    base = BaseModel.objects.get(name="bench-base")
    project = services.project_create(team=team, name="main")
    task_set = services.task_set_create(
        project=project, name="qa", rows=[{"prompt": f"q{i}", "item": {"answer": str(i)}} for i in range(20)]
    )
    environment = services.environment_create(project=project, name="chat")
    reward = services.reward_definition_create(
        project=project,
        name="exact",
        spec={
            "type": "string_check",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
    )
    trainable = [
        services.trainable_model_create(project=project, name=f"agent-{i}", base_model=base)
        for i in range(models)
    ]
    now = datetime.now(UTC)
    config = {"steps": STEPS_PER_RUN, "learning_rate": 1e-4, "group_size": SAMPLES}
    with transaction.atomic():
        _copy(
            Run,
            (
                {
                    "project_id": project.pk, "model_id": trainable[i % models].pk, "task_set_id": task_set.pk,
                    "environment_id": environment.pk, "reward_id": reward.pk, "config": config,
                    "status": "succeeded", "current_step": STEPS_PER_RUN, "total_steps": STEPS_PER_RUN,
                    "attempts": 1, "created_at": now, "started_at": now, "finished_at": now, "kind": "platform",
                }  # fmt: skip
                for i in range(runs)
            ),
            ["project_id", "model_id", "task_set_id", "environment_id", "reward_id", "config", "status",
             "current_step", "total_steps", "attempts", "created_at", "started_at", "finished_at", "kind"],
        )  # fmt: skip
        run_ids = list(Run.objects.filter(project=project).order_by("id").values_list("id", flat=True))
        _copy(
            StepMetrics,
            (
                {"run_id": run_id, "step": step, "reward_mean": rng.random(), "reward_std": 0.1, "loss": 0.01,
                 "metrics": {"tokens": 512, "step_seconds": 7.5, "kl": 0.001}, "created_at": now}
                for run_id in run_ids
                for step in range(1, STEPS_PER_RUN + 1)
            ),
            ["run_id", "step", "reward_mean", "reward_std", "loss", "metrics", "created_at"],
        )  # fmt: skip
        _copy(
            Trajectory,
            (
                {"run_id": run_id, "step": step, "group_index": group, "sample_index": sample,
                 "task_row_index": group, "messages": MESSAGES, "reward": float(sample % 2),
                 "sub_rewards": '{"exact": 1.0}', "errors": "[]", "metrics": '{"turns": 1}',
                 "prompt_tokens": 40, "completion_tokens": 3, "finish_reason": "stop"}
                for run_id in run_ids
                for step in range(1, STEPS_PER_RUN + 1)
                for group in range(GROUPS)
                for sample in range(SAMPLES)
            ),
            ["run_id", "step", "group_index", "sample_index", "task_row_index", "messages", "reward",
             "sub_rewards", "errors", "metrics", "prompt_tokens", "completion_tokens", "finish_reason"],
        )  # fmt: skip
        # Checkpoint 0..N-1 of each model, each from the model's last run (by id) that has that many steps.
        last_run_of = {model.pk: run_ids[i] for i, model in enumerate(trainable) if i < len(run_ids)}
        _copy(
            Checkpoint,
            (
                {"model_id": model.pk, "run_id": last_run_of.get(model.pk), "step": step,
                 "path": f"/data/checkpoints/{model.pk}/step-{step}", "metrics": {"eval.mean_reward": 0.5},
                 "created_at": now}
                for model in trainable
                for step in range(CHECKPOINTS_PER_MODEL)
            ),
            ["model_id", "run_id", "step", "path", "metrics", "created_at"],
        )  # fmt: skip
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return {"name": name, "key": key, "team_id": team.pk}


def build(runs: int) -> None:
    from projects import services

    services.base_model_register(name="bench-base", source="/nonexistent/bench")
    for name, size, models, seed in (
        ("big", runs, MODELS_PER_TEAM, 1),
        ("twin", runs, MODELS_PER_TEAM, 2),
        ("small", 120, 1, 3),
    ):
        started = time.perf_counter()
        build_team(name, size, models, seed)
        print(f"  built team {name}: {size} runs in {time.perf_counter() - started:.1f} s", flush=True)


def team_key(name: str) -> str:
    """A fresh API key for a team of a kept database (the plaintext is never stored)."""
    from projects import services
    from projects.models import Team

    return services.api_key_create(team=Team.objects.get(name=name), name=f"bench-{time.time_ns()}").plaintext


# --- measuring ---------------------------------------------------------------------------------


def endpoints(team_name: str, rng: random.Random) -> dict[str, Any]:
    """Per endpoint, a function giving the next URL to request (a random run or model of the team)."""
    from projects.models import Run, TrainableModel

    run_ids = list(Run.objects.filter(project__team__name=team_name).values_list("id", flat=True))
    model_ids = list(
        TrainableModel.objects.filter(project__team__name=team_name).values_list("id", flat=True)
    )
    return {
        "runs list": lambda: "/api/v1/runs/",
        "run metrics": lambda: f"/api/v1/runs/{rng.choice(run_ids)}/metrics/",
        "step trajectories": lambda: (
            f"/api/v1/runs/{rng.choice(run_ids)}/trajectories/?step={rng.randint(1, STEPS_PER_RUN)}"
        ),
        "checkpoint list": lambda: f"/api/v1/models/{rng.choice(model_ids)}/checkpoints/",
        "/v1/models": lambda: "/v1/models",
    }


def measure(team_name: str, key: str, requests: int, seed: int) -> dict[str, dict[str, float]]:
    from django.db import connection, reset_queries
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from projects.gateway import views as gateway_views

    client = Client(HTTP_AUTHORIZATION=f"Bearer {key}")
    rng = random.Random(seed)
    figures = {}
    for label, next_url in endpoints(team_name, rng).items():
        for _ in range(WARMUP):
            response = client.get(next_url(), secure=True)
            assert response.status_code == 200, (label, response.status_code, response.content[:300])
        reset_queries()  # each request resets the log (request_started), so start from empty
        with CaptureQueriesContext(connection) as queries:
            if label == "/v1/models":
                # The gateway runs its body on its own database threads: count that body here.
                gateway_views._list_models(f"Bearer {key}")
            else:
                client.get(next_url(), secure=True)
        query_count = len(queries.captured_queries)  # now: the property reads the live log
        times = []
        items = 0
        for _ in range(requests):
            url = next_url()
            started = time.perf_counter()
            response = client.get(url, secure=True)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, (label, response.status_code)
            items = len(response.json()["data"])
        times.sort()
        figures[label] = {
            "p50_ms": statistics.median(times),
            "p95_ms": times[int(0.95 * len(times)) - 1],
            "queries": query_count,
            "items": items,
        }
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = server_url()
    bench_url = with_database(url, args.database)
    exists = database_exists(url, args.database)
    if args.reuse and not exists:
        sys.exit(f"--reuse: database {args.database} does not exist (build it with --keep)")
    if not args.reuse:
        if exists:
            admin_execute(url, f'DROP DATABASE "{args.database}" WITH (FORCE)')
        admin_execute(url, f'CREATE DATABASE "{args.database}"')
    setup_django(bench_url)
    from django.core.management import call_command

    try:
        call_command("migrate", verbosity=0)  # on --reuse: indexes added since the build
        if not args.reuse:
            started = time.perf_counter()
            print(f"building: {args.runs} runs, {args.runs * STEPS_PER_RUN} step metrics, "
                  f"{args.runs * STEPS_PER_RUN * GROUPS * SAMPLES} trajectories per team, two teams", flush=True)  # fmt: skip
            build(args.runs)
            print(f"build: {time.perf_counter() - started:.1f} s", flush=True)
        keys = {name: team_key(name) for name in ("big", "small")}
        results = {name: measure(name, keys[name], args.requests, seed=7) for name in ("big", "small")}
    finally:
        from django.db import connections

        connections.close_all()
        if not args.keep:
            admin_execute(url, f'DROP DATABASE IF EXISTS "{args.database}" WITH (FORCE)')
    load = os.getloadavg()
    print(f"\nDjango test client, {args.requests} requests per endpoint after {WARMUP} warm-ups; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")  # fmt: skip
    print(
        f"{'endpoint':<20} {'big p50':>8} {'big p95':>8} {'small p95':>10} {'p95 big/small':>14} {'queries big/small':>18} {'items':>6}"
    )
    worst = 0.0
    for label, big in results["big"].items():
        small = results["small"][label]
        worst = max(worst, big["p95_ms"])
        print(
            f"{label:<20} {big['p50_ms']:>7.1f}ms {big['p95_ms']:>7.1f}ms {small['p95_ms']:>9.1f}ms "
            f"{big['p95_ms'] / small['p95_ms']:>13.2f}x {big['queries']:>9}/{small['queries']:<8} {big['items']:>6}"
        )
    print(f"worst p95 at the big size: {worst:.1f} ms (goal < 50 ms): {'met' if worst < 50 else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"runs": args.runs, "load": load, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
