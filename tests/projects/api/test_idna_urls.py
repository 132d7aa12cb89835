"""Internationalised host names on every URL write and call (issue 22): judge endpoints, webhooks
and MCP environments store ``https://例え.テスト/v1`` as ``https://xn--r8jz45g.xn--zckzah/v1`` (or
answer 400 naming the field when the name is not valid IDNA), and a row stored with a non-ASCII host
before that rule is called by its IDNA name or fails with a readable error: never a 500, never a
webhook delivery left pending."""

from __future__ import annotations

import json

import pytest

from projects.models import DeliveryStatus, Environment, JudgeEndpoint, WebhookEndpoint
from projects.services import judges, webhooks
from tests.conftest import error_of
from tests.listener import FakeDNS, chat_completion, listening

pytestmark = pytest.mark.django_db

PUNYCODE_HOST = "xn--r8jz45g.xn--zckzah"  # 例え.テスト
INVALID_HOSTS = ["☃.example", "ü" * 60 + ".example"]  # a disallowed code point; a label over 63


@pytest.fixture
def dns(monkeypatch) -> FakeDNS:
    fake = FakeDNS(monkeypatch)
    fake.add(PUNYCODE_HOST, "93.184.216.34")  # a public address: the write-time check passes
    return fake


# --- writes ----------------------------------------------------------------------------------


def test_a_judge_endpoint_stores_a_non_ascii_host_as_its_punycode(alice_client, dns):
    created = alice_client.post(
        "/api/v1/judge-endpoints/", {"name": "j", "base_url": "https://例え.テスト/v1"}, format="json"
    )
    assert created.status_code == 201, created.json()
    assert JudgeEndpoint.objects.get().base_url == f"https://{PUNYCODE_HOST}/v1"
    assert created.json()["base_url"] == f"https://{PUNYCODE_HOST}/v1"


def test_patching_a_judge_endpoint_to_the_same_name_typed_in_unicode_keeps_its_key(cast, dns):
    endpoint = judges.judge_endpoint_create(
        team=cast.alpha, name="j", base_url="https://例え.テスト/v1", api_key="sk-kept"
    )
    # The stored form is compared, so the key need not be given again for the same host.
    judges.judge_endpoint_update(endpoint=endpoint, base_url="https://例え.テスト/v1", timeout_s=5)
    endpoint.refresh_from_db()
    assert endpoint.base_url == f"https://{PUNYCODE_HOST}/v1" and endpoint.api_key_encrypted


@pytest.mark.parametrize("host", INVALID_HOSTS)
def test_a_judge_endpoint_on_an_invalid_idna_host_is_400_on_base_url(alice_client, cast, host):
    created = alice_client.post(
        "/api/v1/judge-endpoints/", {"name": "j", "base_url": f"https://{host}/v1"}, format="json"
    )
    assert created.status_code == 400
    assert error_of(created)["param"] == "base_url" and "not a valid name" in error_of(created)["message"]
    endpoint = judges.judge_endpoint_create(team=cast.alpha, name="k", base_url="https://judge.invalid/v1")
    patched = alice_client.patch(
        f"/api/v1/judge-endpoints/{endpoint.pk}/", {"base_url": f"https://{host}/v1"}, format="json"
    )
    assert patched.status_code == 400 and error_of(patched)["param"] == "base_url"


def test_a_host_that_outgrows_the_column_once_encoded_is_400_not_a_database_error(alice_client, dns):
    url = "https://例え.テスト/" + "パ" * 150  # 170 characters typed, over 500 percent-encoded
    created = alice_client.post("/api/v1/judge-endpoints/", {"name": "j", "base_url": url}, format="json")
    assert created.status_code == 400 and error_of(created)["param"] == "base_url"


def test_a_webhook_stores_a_non_ascii_host_as_its_punycode_or_is_400(alice_client, dns):
    created = alice_client.post(
        "/api/v1/webhooks/", {"name": "ci", "url": "https://例え.テスト/hook", "events": ["*"]}, format="json"
    )
    assert created.status_code == 201, created.json()
    assert WebhookEndpoint.objects.get().url == f"https://{PUNYCODE_HOST}/hook"
    for host in INVALID_HOSTS:
        refused = alice_client.post(
            "/api/v1/webhooks/", {"name": "x", "url": f"https://{host}/hook", "events": ["*"]}, format="json"
        )
        assert refused.status_code == 400 and error_of(refused)["param"] == "url", host
        patched = alice_client.patch(
            f"/api/v1/webhooks/{created.json()['id']}/", {"url": f"https://{host}/hook"}, format="json"
        )
        assert patched.status_code == 400 and error_of(patched)["param"] == "url", host


def test_an_mcp_environment_stores_a_non_ascii_host_as_its_punycode_or_is_400(alice_client, alpha_setup, dns):
    def create(url, name):
        return alice_client.post(
            "/api/v1/environments/",
            {"project": alpha_setup.project.pk, "name": name, "kind": "mcp", "config": {"url": url}},
            format="json",
        )

    created = create("https://例え.テスト/mcp", "tools")
    assert created.status_code == 201, created.json()
    assert Environment.objects.get(name="tools").config["url"] == f"https://{PUNYCODE_HOST}/mcp"
    for host in INVALID_HOSTS:
        refused = create(f"https://{host}/mcp", "other")
        assert refused.status_code == 400 and error_of(refused)["param"] == "config.url", host


# --- calls, rows stored before the writes were normalised ---------------------------------------


def _generate(client, setup, endpoint):
    body = {
        "project": setup.project.id,
        "environment": setup.environment.id,
        "endpoint": endpoint.id,
        "n": 2,
        "instruction": "single-word answers",
        "name": "generated",
    }
    return client.post("/api/v1/task-sets/generate", body, format="json")


def test_task_set_generation_reaches_a_non_ascii_host_by_its_idna_name(
    alice_client, cast, alpha_setup, monkeypatch
):
    FakeDNS(monkeypatch).add(PUNYCODE_HOST, "127.0.0.1")  # loopback is allow-listed in tests
    with listening() as listener:
        listener.body = chat_completion(
            json.dumps(
                [{"prompt": "one", "item": {"answer": "a"}}, {"prompt": "two", "item": {"answer": "b"}}]
            )
        )
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=listener.url + "/v1", default_model="writer-model"
        )
        # A legacy row: written directly, as before the write path encoded the name.
        JudgeEndpoint.objects.filter(pk=endpoint.pk).update(base_url=f"http://例え.テスト:{listener.port}/v1")
        generated = _generate(alice_client, alpha_setup, endpoint)
        assert generated.status_code == 201, generated.json()
        assert listener.hosts[0] == f"{PUNYCODE_HOST}:{listener.port}"


def test_task_set_generation_to_a_stored_invalid_idna_host_is_a_clear_400(alice_client, cast, alpha_setup):
    endpoint = judges.judge_endpoint_create(
        team=cast.alpha, name="writer", base_url="https://judge.invalid/v1", default_model="writer-model"
    )
    JudgeEndpoint.objects.filter(pk=endpoint.pk).update(base_url="https://☃.example/v1")
    response = _generate(alice_client, alpha_setup, endpoint)
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["param"] == "endpoint" and "the host is not a valid name" in error["message"]


def test_a_webhook_to_a_stored_non_ascii_host_is_delivered_by_its_idna_name(cast, monkeypatch):
    FakeDNS(monkeypatch).add(PUNYCODE_HOST, "127.0.0.1")
    monkeypatch.setattr(webhooks, "_enqueue", lambda delivery_id: None)
    with listening() as listener:
        created = webhooks.webhook_endpoint_create(
            team=cast.alpha, name="ci", url=listener.url + "/hook", events=["*"]
        )
        WebhookEndpoint.objects.filter(pk=created.endpoint.pk).update(
            url=f"http://例え.テスト:{listener.port}/hook"
        )
        delivery = webhooks.webhook_test(endpoint=created.endpoint)
        assert webhooks.webhook_attempt(delivery_id=delivery.pk).delivered
        assert listener.hosts == [f"{PUNYCODE_HOST}:{listener.port}"]
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.SUCCEEDED


def test_a_webhook_to_a_stored_invalid_idna_host_fails_with_a_readable_error(cast, monkeypatch):
    monkeypatch.setattr(webhooks, "_enqueue", lambda delivery_id: None)
    created = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="ci", url="http://127.0.0.1:9/hook", events=["*"]
    )
    WebhookEndpoint.objects.filter(pk=created.endpoint.pk).update(url="https://☃.example/hook")
    delivery = webhooks.webhook_test(endpoint=created.endpoint)
    assert webhooks.webhook_attempt(delivery_id=delivery.pk) == webhooks.Attempt(
        delivered=False, retry_in_s=None
    )
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.FAILED
    assert "refused by the outbound policy: the host is not a valid name" in delivery.error


def test_a_webhook_request_http_client_cannot_write_is_retried_not_left_pending(cast, monkeypatch):
    """A stored URL with a space: http.client raises InvalidURL (no OSError) before connecting."""
    monkeypatch.setattr(webhooks, "_enqueue", lambda delivery_id: None)
    created = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="ci", url="http://127.0.0.1:9/hook", events=["*"]
    )
    WebhookEndpoint.objects.filter(pk=created.endpoint.pk).update(url="http://127.0.0.1:9/a hook")
    delivery = webhooks.webhook_test(endpoint=created.endpoint)
    attempt = webhooks.webhook_attempt(delivery_id=delivery.pk)
    assert not attempt.delivered and attempt.retry_in_s is not None
    delivery.refresh_from_db()
    assert delivery.status == DeliveryStatus.PENDING and delivery.next_attempt_at is not None
    assert delivery.error.startswith("InvalidURL:")
