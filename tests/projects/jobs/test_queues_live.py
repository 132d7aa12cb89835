"""The no-worker check against a real ``celery worker`` on Redis: the control ping's real reply is
what ``listening_queues`` reads, so a queue with a live consumer is not warned about and one
without is (test_queues.py fakes that reply; this checks the fake's shape once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from projects.jobs import queues
from projects.models import Run, RunEvent
from tests import factories
from tests.processes import Process, test_database_url

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.django_db, pytest.mark.slow]


@pytest.fixture
def gpu_small_worker(tmp_path) -> Process:
    if not settings.CELERY_BROKER_URL.startswith("redis://"):
        pytest.skip("needs CELERY_BROKER_URL pointing at Redis (make test sets it)")
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "ARTWEB_DATA_DIR": str(tmp_path / "worker-data"),
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable, "-m", "celery", "-A", "artweb", "worker", "-Q", "gpu-small", "-c", "1",
        "--prefetch-multiplier", "1", "--loglevel", "INFO", "-n", f"queues-{os.getpid()}@%h",
    ]  # fmt: skip
    log = tmp_path / "worker.log"
    with open(log, "wb") as handle:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    worker = Process("worker", process, log)
    deadline = time.monotonic() + 120
    while "ready." not in worker.output():
        if process.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            pytest.fail(f"celery worker did not start:\n{worker.output()[-3000:]}")
        time.sleep(0.2)
    yield worker
    worker.stop()


def test_a_real_worker_serves_its_queue_and_the_other_one_is_warned(gpu_small_worker, settings):
    settings.QUEUE_NO_WORKER_TIMEOUT_S = 60
    settings.QUEUE_PING_TIMEOUT_S = 5.0  # two shared cores: give the worker time to answer
    assert "gpu-small" in (queues.listening_queues(timeout_s=5.0) or set())
    runs = {}
    for queue in ("gpu-small", "gpu-large"):
        base = factories.BaseModelFactory(queue=queue)
        runs[queue] = factories.RunFactory(model=factories.TrainableModelFactory(base_model=base))
    Run.objects.update(created_at=timezone.now() - timedelta(seconds=120))
    assert queues.warn_unserved_queues() == ["gpu-large"]
    warned = RunEvent.objects.filter(data__has_key=queues.UNSERVED_KEY)
    assert list(warned.values_list("run_id", flat=True)) == [runs["gpu-large"].pk]
