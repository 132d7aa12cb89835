"""The webhooks pages: owners add an endpoint (secret shown once), send a test event, redeliver,
rotate and delete; members and viewers read; another team's webhook is a 404."""

from __future__ import annotations

import pytest

from projects.models import WebhookDelivery, WebhookEndpoint
from projects.services import webhooks
from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db

URL = "http://127.0.0.1:9/hook"  # the discard port; nothing is sent (deliveries are not run here)


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(webhooks, "_enqueue", lambda delivery_id: None)


def test_an_owner_adds_a_webhook_and_sees_its_secret_once(cast):
    client = client_for(cast.alice)
    page = client.post(
        "/team/webhooks", {"name": "ci", "url": URL, "events": ["run.*", "checkpoint.created"]}
    )
    assert page.status_code == 200
    endpoint = WebhookEndpoint.objects.get()
    secret = page.context["created"].secret
    assert secret.startswith("whsec_") and secret in page.content.decode()
    assert endpoint.events == ["checkpoint.created", "run.*"]
    again = client.get("/team/webhooks").content.decode()
    assert secret not in again and 'data-webhook="ci"' in again


def test_a_refused_url_is_shown_next_to_its_field(cast, settings):
    settings.OUTBOUND_ALLOW = []
    page = client_for(cast.alice).post("/team/webhooks", {"name": "ci", "url": URL, "events": ["*"]})
    assert page.status_code == 200 and not WebhookEndpoint.objects.exists()
    assert page.context["form"].errors["url"], page.context["form"].errors


def test_test_event_redeliver_rotate_and_delete(cast):
    created = webhooks.webhook_endpoint_create(team=cast.alpha, name="ci", url=URL, events=["*"])
    pk, client = created.endpoint.pk, client_for(cast.alice)
    assert client.post(f"/team/webhooks/{pk}/test").status_code == 302
    delivery = WebhookDelivery.objects.get()
    assert delivery.event_type == "webhook.test"
    detail = client.get(f"/team/webhooks/{pk}/").content.decode()
    assert f'data-delivery="{delivery.pk}"' in detail and delivery.event_id in detail
    client.post(f"/team/webhooks/{pk}/deliveries/{delivery.pk}/redeliver")
    assert list(WebhookDelivery.objects.values_list("event_id", flat=True)) == [delivery.event_id] * 2
    rotated = client.post(f"/team/webhooks/{pk}/rotate")
    assert (
        rotated.context["secret"] != created.secret and rotated.context["secret"] in rotated.content.decode()
    )
    client.post(f"/team/webhooks/{pk}/delete")
    assert not WebhookEndpoint.objects.exists() and not WebhookDelivery.objects.exists()


def test_viewers_read_but_cannot_change_and_outsiders_get_404(cast):
    created = webhooks.webhook_endpoint_create(team=cast.alpha, name="ci", url=URL, events=["*"])
    pk = created.endpoint.pk
    viewer = client_for(cast.bob)
    assert viewer.get("/team/webhooks").status_code == 200
    assert "Only team owners" in viewer.get("/team/webhooks").content.decode()
    assert viewer.get(f"/team/webhooks/{pk}/").status_code == 200
    for path in ("/team/webhooks", f"/team/webhooks/{pk}/test", f"/team/webhooks/{pk}/delete"):
        assert viewer.post(path, {"name": "x", "url": URL, "events": ["*"]}).status_code == 403, path
    outsider = client_for(cast.charlie)
    assert outsider.get(f"/team/webhooks/{pk}/").status_code == 404
    assert outsider.post(f"/team/webhooks/{pk}/delete").status_code == 404
    assert WebhookEndpoint.objects.filter(pk=pk).exists()
