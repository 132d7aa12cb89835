"""Real parts: PostgreSQL and Redis on 127.0.0.1 and `celery worker` subprocesses.

The test process and the workers share the pytest-django test database (transactional tests, so
rows are committed and visible across processes) and a Redis database used only by these tests.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings

from tests.openai_stub import LOOPBACK_ALLOWED
from tests.processes import Process, test_database_url

ROOT = Path(__file__).resolve().parents[2]


Worker = Process  # a `celery worker` child

# Starting a worker costs ~7 s of CPU (Django, Celery, torch, transformers, peft) and more wall time
# on two loaded cores, and most tests need one with the same settings as some test before. A worker
# a test leaves alive and idle goes back to a small pool (per pytest process, keyed by its extra
# settings), and the next test asking for those settings gets it instead of a new process. A worker
# the test killed or stopped, or one still running a task at the end of the test, is never reused.
# While pooled, a worker consumes nothing (its queues cancelled over Celery's remote control, so
# another test's worker gets every task) and is stopped with SIGSTOP (its embedded beat sends no
# periodic tasks meanwhile); it is continued and its queues added back when leased. What a test
# sees of a reused worker is its own part: ``output()`` starts where its lease began.
POOL_SIZE = 2  # idle workers kept per pytest process (each holds torch and a model: ~1 GB)
QUEUES = ("train", "default")
_idle: dict[tuple, list[LeasedWorker]] = {}  # settings key -> idle workers, oldest first
_started = itertools.count()
_TASK_ID = re.compile(r"\[([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\]")
_TASK_ENDS = (" succeeded in ", " raised ", " failed", " retry", " rejected", " ignored", " revoked")


@dataclass
class LeasedWorker(Process):
    """A worker as one test holds it: its log read from ``offset`` (where the lease began)."""

    offset: int = 0
    node: str = ""  # the worker's node name, for remote control

    def output(self) -> str:
        with open(self.log, "rb") as handle:
            handle.seek(self.offset)
            return handle.read().decode(errors="replace")

    def lease(self) -> LeasedWorker:
        return LeasedWorker(self.name, self.process, self.log, self.url, self.log.stat().st_size, self.node)


def _idle_now(worker: Process) -> bool:
    """Every task the worker received (its whole log) has ended: nothing of a test runs on into
    the next one. A log it cannot read that way (JSON lines) says no."""
    received: set[str] = set()
    ended: set[str] = set()
    for line in worker.log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            return False
        found = _TASK_ID.search(line)
        if found is None:
            continue
        if " received" in line:
            received.add(found.group(1))
        elif any(end in line for end in _TASK_ENDS):
            ended.add(found.group(1))
    return received <= ended


def _settles(worker: Process) -> bool:
    """Idle now or within a second (a periodic task of its beat may be running)."""
    for _ in range(10):
        if _idle_now(worker):
            return True
        time.sleep(0.1)
    return False


def _control(worker: LeasedWorker, command: str) -> bool:
    """``cancel_consumer`` / ``add_consumer`` of both queues on ``worker``, answered by it."""
    from artweb.celery import app

    for queue in QUEUES:
        method = getattr(app.control, command)
        replies = method(queue, destination=[worker.node], reply=True, timeout=10)
        if not any(worker.node in reply for reply in replies or []):
            return False
    return True


def _park(worker: LeasedWorker) -> bool:
    """Into the pool: consuming nothing, then stopped; False (and the worker ended) if it cannot be."""
    if worker.process.poll() is not None:
        return False
    if _settles(worker) and _control(worker, "cancel_consumer") and _settles(worker):
        os.killpg(worker.process.pid, signal.SIGSTOP)
        return True
    worker.stop()
    return False


def _unpark(worker: LeasedWorker) -> bool:
    """Out of the pool: continued and consuming again; False (and the worker ended) if not."""
    if worker.process.poll() is not None:
        return False
    os.killpg(worker.process.pid, signal.SIGCONT)
    if _control(worker, "add_consumer"):
        return True
    worker.stop()
    return False


def _end(worker: LeasedWorker) -> None:
    if worker.process.poll() is None:
        os.killpg(worker.process.pid, signal.SIGCONT)  # a stopped process takes SIGTERM once continued
    worker.stop()


def _purge_queues(client) -> None:
    """Queued and unacknowledged messages from an earlier test go; kombu's queue bindings stay (a
    FLUSHDB drops them too; a pooled worker declares them again when its queues are added back)."""
    for key in client.keys("*"):
        if not key.startswith(b"_kombu.binding."):
            client.delete(key)


@pytest.fixture(scope="session")
def _worker_pool(tmp_path_factory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("pooled-workers")
    for workers in _idle.values():
        for worker in workers:
            _end(worker)
    _idle.clear()


@pytest.fixture
def start_worker(transactional_db, tmp_path, _worker_pool) -> Iterator[Callable[..., Worker]]:
    broker = settings.CELERY_BROKER_URL
    if not broker.startswith("redis://"):
        pytest.fail("integration tests need CELERY_BROKER_URL pointing at Redis (make test sets it)")
    import redis

    _purge_queues(redis.Redis.from_url(broker))  # no stale messages from an earlier test
    leased: list[tuple[tuple, LeasedWorker]] = []

    def start(**extra_env: str) -> Worker:
        key = tuple(sorted(extra_env.items()))
        while _idle.get(key):
            pooled = _idle[key].pop(0)
            if _unpark(pooled):
                worker = pooled.lease()
                leased.append((key, worker))
                return worker
        number = next(_started)
        env = {
            **os.environ,
            "DATABASE_URL": test_database_url(),
            "CELERY_BROKER_URL": broker,
            "ARTWEB_DATA_DIR": str(_worker_pool / "worker-data"),
            "DEBUG": "1",
            "RUN_HEARTBEAT_TIMEOUT_S": "4",
            "RUN_REAPER_INTERVAL_S": "1",
            "TORCH_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "OUTBOUND_ALLOW": ",".join(LOOPBACK_ALLOWED),  # the test's judge/OpenAI/MCP servers
            **extra_env,
        }
        log = _worker_pool / f"worker-{number}.log"
        node = f"test{number}-{os.getpid()}@{socket.gethostname()}"
        command = [
            sys.executable, "-m", "celery", "-A", "artweb", "worker", "-Q", ",".join(QUEUES), "-c", "1",
            "--prefetch-multiplier", "1", "--loglevel", "INFO", "-n", node,
            "-B", "--schedule", str(_worker_pool / f"beat-{number}"),
        ]  # fmt: skip
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
            )
        worker = LeasedWorker(f"worker-{number}", process, log, node=node)
        leased.append((key, worker))
        deadline = time.monotonic() + 90
        while "ready." not in worker.output():
            if process.poll() is not None or time.monotonic() > deadline:
                worker.kill()
                pytest.fail(f"celery worker did not start:\n{worker.output()[-3000:]}")
            time.sleep(0.2)
        return worker

    yield start
    for key, worker in leased:
        if _park(worker):
            _idle.setdefault(key, []).append(worker)
    while sum(len(workers) for workers in _idle.values()) > POOL_SIZE:  # the longest idle goes
        oldest = min((w for workers in _idle.values() for w in workers), key=lambda w: w.log.stat().st_mtime)
        for workers in _idle.values():
            if oldest in workers:
                workers.remove(oldest)
        _end(oldest)


def wait_for(predicate: Callable[[], object], *, timeout: float, what: str, worker: Worker | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    log = f"\nworker log:\n{worker.output()[-4000:]}" if worker else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what}{log}")
