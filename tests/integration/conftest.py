"""Real parts: PostgreSQL and Redis on 127.0.0.1 and `celery worker` subprocesses.

The test process and the workers share the pytest-django test database (transactional tests, so
rows are committed and visible across processes) and a Redis database used only by these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings

from tests.openai_stub import LOOPBACK_ALLOWED
from tests.processes import Process, test_database_url

ROOT = Path(__file__).resolve().parents[2]


Worker = Process  # a `celery worker` child


@pytest.fixture
def start_worker(transactional_db, tmp_path) -> Iterator[Callable[..., Worker]]:
    broker = settings.CELERY_BROKER_URL
    if not broker.startswith("redis://"):
        pytest.fail("integration tests need CELERY_BROKER_URL pointing at Redis (make test sets it)")
    import redis

    redis.Redis.from_url(broker).flushdb()  # no stale messages from an earlier test
    workers: list[Worker] = []
    data_dir = tmp_path / "worker-data"

    def start(**extra_env: str) -> Worker:
        env = {
            **os.environ,
            "DATABASE_URL": test_database_url(),
            "CELERY_BROKER_URL": broker,
            "ARTWEB_DATA_DIR": str(data_dir),
            "DEBUG": "1",
            "RUN_HEARTBEAT_TIMEOUT_S": "4",
            "RUN_REAPER_INTERVAL_S": "1",
            "TORCH_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "OUTBOUND_ALLOW": ",".join(LOOPBACK_ALLOWED),  # the test's judge/OpenAI/MCP servers
            **extra_env,
        }
        log = tmp_path / f"worker-{len(workers)}.log"
        command = [
            sys.executable, "-m", "celery", "-A", "artweb", "worker", "-Q", "train,default", "-c", "1",
            "--prefetch-multiplier", "1", "--loglevel", "INFO", "-n", f"test{len(workers)}@%h",
            "-B", "--schedule", str(tmp_path / f"beat-{len(workers)}"),
        ]  # fmt: skip
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        worker = Worker(f"worker-{len(workers)}", process, log)
        workers.append(worker)
        deadline = time.monotonic() + 90
        while "ready." not in worker.output():
            if process.poll() is not None or time.monotonic() > deadline:
                worker.kill()
                pytest.fail(f"celery worker did not start:\n{worker.output()[-3000:]}")
            time.sleep(0.2)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def wait_for(predicate: Callable[[], object], *, timeout: float, what: str, worker: Worker | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    log = f"\nworker log:\n{worker.output()[-4000:]}" if worker else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what}{log}")
