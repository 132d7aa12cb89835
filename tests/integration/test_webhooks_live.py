"""Webhooks through a real Celery worker: deliveries leave after commit, a 5xx is retried by Celery
with backoff, and a run's checkpoints and its success reach a subscribed endpoint, signed."""

from __future__ import annotations

import json

import pytest
from django.conf import settings

from projects.models import DeliveryStatus, WebhookDelivery
from projects.services import webhooks
from tests.integration.conftest import wait_for
from tests.integration.test_training_runs import api, create_run, inputs, status_of  # noqa: F401  (fixtures)
from tests.projects.api.test_webhooks import Receiver, verify

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_worker_delivers_retries_and_announces_a_run(start_worker, api, inputs, cast):  # noqa: F811
    receiver = Receiver([500])  # the first POST fails; Celery retries it
    try:
        # The worker decrypts the endpoint's secret: it shares the web process's SECRET_KEY.
        worker = start_worker(WEBHOOK_RETRY_BASE_S="1", SECRET_KEY=settings.SECRET_KEY)
        created = api.post(
            "/api/v1/webhooks/",
            {"name": "ci", "url": receiver.url, "events": ["run.succeeded", "checkpoint.created"]},
            format="json",
        )
        assert created.status_code == 403  # an API key is not an owner: keys are not people
        hook = webhooks.webhook_endpoint_create(
            team=cast.alpha, name="ci", url=receiver.url, events=["run.succeeded", "checkpoint.created"]
        )
        test = webhooks.webhook_test(endpoint=hook.endpoint)
        wait_for(
            lambda: WebhookDelivery.objects.get(pk=test.pk).status == DeliveryStatus.SUCCEEDED,
            timeout=60, what="the test event, retried after a 500", worker=worker,
        )  # fmt: skip
        delivery = WebhookDelivery.objects.get(pk=test.pk)
        assert delivery.attempts == 2 and delivery.response_status == 200
        assert [r["headers"]["Artweb-Webhook-Id"] for r in receiver.received] == [test.event_id] * 2

        run_id = create_run(api, inputs, "hooked", steps=1)
        wait_for(lambda: status_of(run_id) == "succeeded", timeout=180, what="the run", worker=worker)
        wait_for(lambda: len(receiver.received) >= 5, timeout=60, what="the run's events", worker=worker)
        events = [json.loads(r["body"]) for r in receiver.received[2:]]
        assert sorted(e["type"] for e in events) == [
            "checkpoint.created",
            "checkpoint.created",
            "run.succeeded",
        ]
        assert sorted(e["data"]["step"] for e in events if e["type"] == "checkpoint.created") == [0, 1]
        assert all(verify(hook.secret, r["headers"], r["body"]) for r in receiver.received)
    finally:
        receiver.close()
