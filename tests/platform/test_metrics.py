"""Prometheus metrics (projects.metrics): /metrics is the operator's (token or nothing), parses as
Prometheus text, and carries request latency by URL pattern, work items by state and step series."""

from __future__ import annotations

from unittest import mock

import pytest
from prometheus_client.parser import text_string_to_metric_families

from projects import metrics, services
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def test_metrics_are_off_without_a_token_and_refused_with_a_wrong_one(client, settings):
    settings.METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 404
    settings.METRICS_TOKEN = "op-secret"
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer op-secret").status_code == 200


def test_a_scrape_has_latency_by_route_and_work_items_by_state(cast, alpha_setup, client, settings):
    settings.METRICS_TOKEN = "op-secret"
    with mock.patch.object(services.runs, "_enqueue_run", lambda run_id: None):
        services.run_create(
            model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
            reward=alpha_setup.reward, config={"steps": 1},
        )  # fmt: skip
    before = samples(client.get("/metrics", HTTP_AUTHORIZATION="Bearer op-secret").content.decode())
    api = client_for(cast.alice)
    assert api.get("/api/v1/runs/").status_code == 200
    assert api.get("/api/v1/runs/999999/").status_code == 404
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer op-secret")
    assert response["Content-Type"].startswith("text/plain")
    found = samples(response.content.decode())
    key = {"route": "/api/v1/runs/", "method": "GET", "status": "200"}
    count = value(found, "artweb_http_request_duration_seconds_count", **key)
    assert count == (value(before, "artweb_http_request_duration_seconds_count", **key) or 0) + 1
    # The pattern, not the id: one series for every run's detail page.
    assert value(found, "artweb_http_request_duration_seconds_count", route="/api/v1/runs/<pk>/", method="GET",
                 status="404") is not None  # fmt: skip
    assert value(found, "artweb_work_items", kind="run", status="queued") == 1
    assert not any("999999" in str(labels) for _, labels in found)


def test_a_recorded_step_feeds_the_step_series():
    before = metrics.STEP_SECONDS.labels("platform")._sum.get()
    metrics.observe_step(
        kind="platform",
        metrics={"step_seconds": 12.5, "rollout_seconds": 8.0, "train_seconds": 4.0, "sync_seconds": 0.5,
                 "completion_tokens": 300.0, "trainable_tokens": 280.0, "grader_errors": 2.0, "loss": True},
    )  # fmt: skip
    assert metrics.STEP_SECONDS.labels("platform")._sum.get() == before + 12.5
    assert metrics.GRADER_ERRORS.labels("platform")._value.get() >= 2


def test_route_labels_are_patterns_without_ids():
    assert metrics.route_label("api/v1/runs/$") == "/api/v1/runs/"
    assert metrics.route_label("api/v1/runs/(?P<pk>[^/.]+)/$") == "/api/v1/runs/<pk>/"
    assert metrics.route_label("runs/<int:run_id>/live") == "/runs/<run_id>/live"


def test_model_labels_drop_the_step():
    assert metrics.model_label("math/agent:17") == "math/agent"
    assert metrics.model_label("math/agent:latest") == "math/agent"
    assert metrics.model_label("smollm2-135m") == "smollm2-135m"


def test_a_starting_worker_clears_only_dead_processes_samples(tmp_path, monkeypatch):
    import os
    import subprocess

    from artweb import celery

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"counter_{dead.pid}.db").write_bytes(b"old run")
    (tmp_path / f"histogram_{os.getpid()}.db").write_bytes(b"a live process's samples")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing-then-made"))
    celery._fresh_metrics_folder()
    assert (tmp_path / "missing-then-made").is_dir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    celery._fresh_metrics_folder()
    assert sorted(p.name for p in tmp_path.glob("*.db")) == [f"histogram_{os.getpid()}.db"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str, token: str | None = None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_the_workers_metrics_need_the_token_and_without_one_stay_on_loopback(settings, tmp_path, monkeypatch):
    """The worker's own endpoint (issue 51): with METRICS_TOKEN only "Bearer $METRICS_TOKEN" reads
    it, like the web's; without one it does not listen on a network address at all."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    settings.METRICS_BIND_ADDRESS, settings.METRICS_TOKEN = "0.0.0.0", ""
    settings.WORKER_METRICS_PORT = _free_port()
    assert metrics.start_worker_metrics_server() is None  # refused: every interface, no token

    settings.METRICS_TOKEN, settings.WORKER_METRICS_PORT = "scrape-me", _free_port()
    server = metrics.start_worker_metrics_server()
    assert server is not None
    try:
        url = f"http://127.0.0.1:{settings.WORKER_METRICS_PORT}/metrics"
        assert _get(url) == 401 and _get(url, "wrong") == 401
        assert _get(url, "scrape-me") == 200
    finally:
        server.shutdown()
        server.server_close()

    settings.METRICS_BIND_ADDRESS, settings.METRICS_TOKEN = "127.0.0.1", ""
    settings.WORKER_METRICS_PORT = _free_port()
    server = metrics.start_worker_metrics_server()  # loopback: this host's own scraper
    assert server is not None
    try:
        assert _get(f"http://127.0.0.1:{settings.WORKER_METRICS_PORT}/metrics") == 200
    finally:
        server.shutdown()
        server.server_close()
