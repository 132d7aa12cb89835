"""A real worker's Prometheus endpoint after a real run on the tiny model: step time split by
phase, tokens, the job's outcome, summed across Celery's forked pool child (multiprocess mode)."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from tests.integration.conftest import wait_for
from tests.integration.test_training_runs import api, create_run, inputs, status_of  # noqa: F401  (fixtures)
from tests.platform.test_metrics import samples, value

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_worker_metrics_after_a_run(start_worker, api, inputs, tmp_path):  # noqa: F811
    port, folder = _free_port(), tmp_path / "prometheus"
    folder.mkdir()
    worker = start_worker(PROMETHEUS_MULTIPROC_DIR=str(folder), WORKER_METRICS_PORT=str(port))
    run_id = create_run(api, inputs, "measured", steps=2)
    wait_for(lambda: status_of(run_id) == "succeeded", timeout=180, what="the run", worker=worker)

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return samples(response.read().decode())

    found = wait_for(
        lambda: (s := scrape()) and value(s, "artweb_jobs_finished_total", kind="run", outcome="succeeded") and s,
        timeout=30, what="the finished run in the worker's metrics", worker=worker,
    )  # fmt: skip
    assert value(found, "artweb_step_seconds_count", kind="platform") == 2
    for phase in ("rollout", "update", "sync"):
        assert value(found, "artweb_step_phase_seconds_count", kind="platform", phase=phase) == 2, phase
    assert value(found, "artweb_tokens_total", kind="platform", what="sampled") > 0
    assert value(found, "artweb_tokens_total", kind="platform", what="trained") > 0
