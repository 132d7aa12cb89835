"""The playground's session path to the gateway: CSRF-protected, scoped to the session's team.

Transactional: the gateway resolves models on its own database threads, which see only committed
rows. The streaming itself is exercised in Chromium against a real inference server
(tests/browser)."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import services

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(user, *, enforce_csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=enforce_csrf)
    client.force_login(user)
    return client


def chat(client: Client, model: str, **headers):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return client.post("/playground/chat", json.dumps(body), content_type="application/json", **headers)


def test_playground_refuses_a_post_without_the_csrf_token(cast):
    assert chat(signed_in(cast.alice, enforce_csrf=True), "tiny").status_code == 403


def test_playground_resolves_models_in_the_sessions_team_only(cast):
    base = services.base_model_register(name="tiny", source="/nonexistent")
    beta_project = services.project_create(team=cast.beta, name="beta-project")
    beta_model = services.trainable_model_create(project=beta_project, name="m", base_model=base)
    services.checkpoint_record(model=beta_model, run=None, step=1, path="/tmp/none")
    response = chat(signed_in(cast.alice), "beta-project/m:1")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    # Its owner gets past routing, to "no inference server is running" (none in this test).
    response = chat(signed_in(cast.charlie), "beta-project/m:1")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_server_available"


@pytest.fixture(autouse=True)
def _close_gateway_connections():
    """The gateway keeps a database connection per thread of its pool; close them after each test
    so the test database can be dropped at the end."""
    yield
    import threading

    from django.db import connections

    try:
        from projects.gateway.db import _db_executor
    except ImportError:  # before the pool moved out of the views module
        from projects.gateway.views import _db_executor  # type: ignore[attr-defined,no-redef]

    threads = len(_db_executor._threads)
    if threads:
        barrier = threading.Barrier(threads)

        def close() -> None:
            barrier.wait(timeout=10)  # one task per thread: each waits until all threads hold one
            connections.close_all()

        for future in [_db_executor.submit(close) for _ in range(threads)]:
            future.result(timeout=20)
