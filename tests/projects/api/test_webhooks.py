"""Webhooks: endpoints (owner writes, viewer reads, outsider 404), the signed POST a receiver can
verify with the documented algorithm, retries with backoff after a 5xx, the outbound policy, the
delivery log, test events and redelivery; and what run, evaluation, checkpoint and training-job
changes announce."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import pytest

from projects import services
from projects.models import DeliveryStatus, RunStatus, WebhookDelivery, WebhookEndpoint
from projects.services import webhooks
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


class Receiver:
    """An HTTP endpoint on loopback answering the statuses it is given, recording what arrives."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append({"headers": dict(self.headers), "body": body})
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"nope" if status >= 400 else b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def no_enqueue():
    with mock.patch.object(webhooks, "_enqueue", lambda delivery_id: None):
        yield


def verify(secret: str, headers: dict, body: bytes, *, tolerance_s: int = 300) -> bool:
    """What a receiver does, as the README documents it."""
    timestamp = int(headers["Artweb-Webhook-Timestamp"])
    if abs(time.time() - timestamp) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["Artweb-Webhook-Signature"], f"v1={expected}")


def test_owner_creates_a_webhook_and_sees_its_secret_once(alice_client, receiver):
    response = alice_client.post(
        "/api/v1/webhooks/",
        {"name": "ci", "url": receiver.url, "events": ["run.*", "checkpoint.created"]},
        format="json",
    )
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["object"] == "webhook" and body["secret"].startswith("whsec_")
    assert body["events"] == ["checkpoint.created", "run.*"]
    again = alice_client.get(f"/api/v1/webhooks/{body['id']}/").json()
    assert "secret" not in again and again["url"] == receiver.url
    listed = alice_client.get("/api/v1/webhooks").json()
    assert listed["object"] == "list" and [w["id"] for w in listed["data"]] == [body["id"]]
    assert WebhookEndpoint.objects.get().secret_encrypted != body["secret"]  # encrypted at rest


def test_viewer_reads_but_cannot_write_and_outsiders_get_404(
    cast, alice_client, bob_client, charlie_client, receiver
):
    created = services.webhooks.webhook_endpoint_create(
        team=cast.alpha, name="ci", url=receiver.url, events=["*"]
    )
    pk = created.endpoint.pk
    assert bob_client.get(f"/api/v1/webhooks/{pk}/").status_code == 200
    for method, path in [("post", "/api/v1/webhooks/"), ("patch", f"/api/v1/webhooks/{pk}/"),
                         ("post", f"/api/v1/webhooks/{pk}/test/"), ("post", f"/api/v1/webhooks/{pk}/rotate-secret/")]:  # fmt: skip
        assert getattr(bob_client, method)(path, {}, format="json").status_code == 403, path
    for method, path in [("get", f"/api/v1/webhooks/{pk}/"), ("get", f"/api/v1/webhooks/{pk}/deliveries/"),
                         ("delete", f"/api/v1/webhooks/{pk}/"), ("post", f"/api/v1/webhooks/{pk}/test/")]:  # fmt: skip
        assert getattr(charlie_client, method)(path).status_code == 404, path
    assert charlie_client.get("/api/v1/webhooks/").json()["data"] == []


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        (
            {"name": "x", "url": "http://127.0.0.1:9/h", "events": ["run.succeded"]},
            "events[0]",
            "run.succeeded",
        ),
        ({"name": "x", "url": "http://127.0.0.1:9/h", "events": []}, "events", "non-empty"),
        ({"name": "x", "url": "ftp://example.com/h", "events": ["*"]}, "url", "http"),
        ({"name": "x", "url": "https://u:p@example.com/h", "events": ["*"]}, "url", "password"),
        ({"name": "Bad Name", "url": "http://127.0.0.1:9/h", "events": ["*"]}, "name", "lowercase"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(alice_client, body, field, reason):
    response = alice_client.post("/api/v1/webhooks/", body, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == field and reason in error["message"], error


def test_private_addresses_are_refused_unless_the_operator_allows_them(alice_client, settings):
    settings.OUTBOUND_ALLOW = []
    for url in (
        "http://127.0.0.1:8000/h",
        "http://10.1.2.3/h",
        "http://169.254.169.254/latest",
        "http://[::1]/h",
    ):
        response = alice_client.post(
            "/api/v1/webhooks/", {"name": "x", "url": url, "events": ["*"]}, format="json"
        )
        assert response.status_code == 400 and error_of(response)["param"] == "url", url


def test_a_delivery_is_signed_as_documented(cast, receiver, no_enqueue):
    created = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="ci", url=receiver.url, events=["webhook.test"]
    )
    delivery = webhooks.webhook_test(endpoint=created.endpoint)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk).delivered
    (request,) = receiver.received
    assert verify(created.secret, request["headers"], request["body"])
    assert not verify("whsec_other", request["headers"], request["body"])
    tampered = request["body"].replace(b"webhook.test", b"webhook.tost")
    assert not verify(created.secret, request["headers"], tampered)
    event = json.loads(request["body"])
    assert event["object"] == "event" and event["type"] == "webhook.test"
    assert request["headers"]["Artweb-Webhook-Id"] == event["id"] == delivery.event_id
    delivery.refresh_from_db()
    assert (
        delivery.status == DeliveryStatus.SUCCEEDED
        and delivery.attempts == 1
        and delivery.response_status == 200
    )
    assert delivery.latency_ms is not None and delivery.delivered_at is not None


def test_a_5xx_is_retried_with_exponential_backoff_up_to_the_cap(cast, settings, no_enqueue):
    settings.WEBHOOK_RETRY_BASE_S, settings.WEBHOOK_RETRY_MAX_S, settings.WEBHOOK_MAX_ATTEMPTS = 10, 25, 4
    server = Receiver([500, 503, 500])
    try:
        created = webhooks.webhook_endpoint_create(team=cast.alpha, name="ci", url=server.url, events=["*"])
        delivery = webhooks.webhook_test(endpoint=created.endpoint)
        retries = [webhooks.webhook_attempt(delivery_id=delivery.pk).retry_in_s for _ in range(3)]
        assert retries == [10, 20, 25], "doubling, capped"
        delivery.refresh_from_db()
        assert delivery.status == DeliveryStatus.PENDING and delivery.response_status == 500
        assert "HTTP 500" in delivery.error and delivery.next_attempt_at is not None
        final = webhooks.webhook_attempt(delivery_id=delivery.pk)
        assert final.delivered and final.retry_in_s is None
        ids = {request["headers"]["Artweb-Webhook-Id"] for request in server.received}
        assert len(server.received) == 4 and ids == {delivery.event_id}, "the same event id on every attempt"
        # A duplicate task message after success sends nothing.
        webhooks.webhook_attempt(delivery_id=delivery.pk)
        assert len(server.received) == 4
    finally:
        server.close()


def test_delivery_gives_up_after_the_last_attempt(cast, settings, no_enqueue):
    settings.WEBHOOK_MAX_ATTEMPTS = 2
    server = Receiver([500, 500])
    try:
        created = webhooks.webhook_endpoint_create(team=cast.alpha, name="ci", url=server.url, events=["*"])
        delivery = webhooks.webhook_test(endpoint=created.endpoint)
        assert webhooks.webhook_attempt(delivery_id=delivery.pk).retry_in_s is not None
        assert webhooks.webhook_attempt(delivery_id=delivery.pk).retry_in_s is None
        delivery.refresh_from_db()
        assert delivery.status == DeliveryStatus.FAILED and delivery.attempts == 2
    finally:
        server.close()


def test_a_url_the_policy_now_refuses_fails_without_a_request_or_retry(cast, receiver, settings, no_enqueue):
    created = webhooks.webhook_endpoint_create(team=cast.alpha, name="ci", url=receiver.url, events=["*"])
    settings.OUTBOUND_ALLOW = []  # the operator tightened the policy after the endpoint was stored
    delivery = webhooks.webhook_test(endpoint=created.endpoint)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) == webhooks.Attempt(
        delivered=False, retry_in_s=None
    )
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.FAILED and "outbound policy" in delivery.error
    assert receiver.received == []


def test_the_log_test_event_and_redelivery_through_the_api(
    cast, alice_client, bob_client, receiver, no_enqueue
):
    created = webhooks.webhook_endpoint_create(team=cast.alpha, name="ci", url=receiver.url, events=["*"])
    pk = created.endpoint.pk
    sent = alice_client.post(f"/api/v1/webhooks/{pk}/test/")
    assert sent.status_code == 202 and sent.json()["event_type"] == "webhook.test"
    webhooks.webhook_attempt(delivery_id=sent.json()["id"])
    log = bob_client.get(f"/api/v1/webhooks/{pk}/deliveries/").json()
    assert log["object"] == "list" and log["data"][0]["status"] == "succeeded"
    assert log["data"][0]["response_status"] == 200 and log["data"][0]["attempts"] == 1
    again = alice_client.post(f"/api/v1/webhooks/{pk}/deliveries/{sent.json()['id']}/redeliver/")
    assert again.status_code == 202
    assert again.json()["event_id"] == sent.json()["event_id"] and again.json()["id"] != sent.json()["id"]
    assert alice_client.post(f"/api/v1/webhooks/{pk}/deliveries/999999/redeliver/").status_code == 404
    rotated = alice_client.post(f"/api/v1/webhooks/{pk}/rotate-secret/").json()["secret"]
    assert rotated != created.secret
    webhooks.webhook_attempt(delivery_id=again.json()["id"])
    assert verify(rotated, receiver.received[-1]["headers"], receiver.received[-1]["body"])


def test_transitions_and_checkpoints_announce_to_subscribed_endpoints(
    cast, alpha_setup, receiver, no_enqueue
):
    runs_only = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="runs", url=receiver.url, events=["run.*"]
    )
    checkpoints = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="ckpt", url=receiver.url, events=["checkpoint.created"]
    )
    webhooks.webhook_endpoint_create(team=cast.beta, name="other-team", url=receiver.url, events=["*"])
    with mock.patch.object(services.runs, "_enqueue_run", lambda run_id: None):
        run = services.run_create(
            model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
            reward=alpha_setup.reward, config={"steps": 1},
        )  # fmt: skip
    claimed = services.run_claim(run_id=run.pk, worker="w")
    assert WebhookDelivery.objects.count() == 0, "queued and running are not announced"
    services.checkpoint_record(model=alpha_setup.model, run=claimed, step=1, path="/tmp/x")
    services.checkpoint_record(model=alpha_setup.model, run=claimed, step=1, path="/tmp/x")  # idempotent
    services.run_transition(run_id=run.pk, to=RunStatus.SUCCEEDED, message="done")
    deliveries = list(WebhookDelivery.objects.order_by("id"))
    assert [(d.endpoint_id, d.event_type) for d in deliveries] == [
        (checkpoints.endpoint.pk, "checkpoint.created"),
        (runs_only.endpoint.pk, "run.succeeded"),
    ]
    assert deliveries[0].payload["data"]["inference_model"] == "math/agent:1"
    assert deliveries[1].payload["data"] == {
        **deliveries[1].payload["data"],
        "id": run.pk,
        "status": "succeeded",
    }
