"""The judge endpoints page: owners add one (the key stored encrypted, never shown), test the
connection through the graders' own client (latency, or the error), and rotate its key; viewers
read; another team's endpoint is a 404."""

from __future__ import annotations

import pytest

from projects import secrets
from projects.models import JudgeEndpoint
from projects.services import judges
from tests.frontend.test_views import client_for
from tests.openai_stub import openai_stub

pytestmark = pytest.mark.django_db


def test_an_owner_adds_an_endpoint_and_its_key_is_stored_encrypted(cast):
    page = client_for(cast.alice).post(
        "/team/judge-endpoints",
        {"name": "default", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-secret-1", "timeout_s": "5"},
        follow=True,
    )
    assert page.status_code == 200
    endpoint = JudgeEndpoint.objects.get(team=cast.alpha)
    assert endpoint.api_key_encrypted and "sk-secret-1" not in endpoint.api_key_encrypted
    assert secrets.decrypt(endpoint.api_key_encrypted) == "sk-secret-1"
    html = page.content.decode()
    assert 'data-judge="default"' in html and "sk-secret-1" not in html and "stored" in html


def test_a_bad_base_url_is_shown_at_its_field(cast):
    page = client_for(cast.alice).post(
        "/team/judge-endpoints", {"name": "x", "base_url": "ftp://nowhere", "timeout_s": "5"}
    )
    assert page.status_code == 200 and not JudgeEndpoint.objects.exists()
    assert page.context["form"].errors["base_url"], page.context["form"].errors


def test_test_connection_shows_the_latency_or_the_error(cast):
    with openai_stub(["OK", 500]) as stub:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=stub.url, api_key="sk-test", default_model="judge-model"
        )
        client = client_for(cast.alice)
        good = client.post(f"/team/judge-endpoints/{endpoint.pk}/test")
        assert good.status_code == 200
        check = good.context["check"]
        assert check.ok and check.detail == "OK" and check.latency_ms >= 0
        assert stub.requests[0]["model"] == "judge-model" and stub.requests[0]["max_tokens"] == 8
        assert stub.headers[0]["Authorization"] == "Bearer sk-test"
        html = good.content.decode()
        assert 'id="judge-check"' in html and 'data-ok="1"' in html and f"{check.latency_ms} ms" in html
        bad = client.post(f"/team/judge-endpoints/{endpoint.pk}/test", {"model": "other-model"})
        assert bad.context["check"].ok is False and "500" in bad.context["check"].detail
        assert 'data-ok="0"' in bad.content.decode() and "sk-test" not in bad.content.decode()
        assert stub.requests[1]["model"] == "other-model"
        assert len(stub.requests) == 2  # no retry: the answer is about one attempt


def test_an_endpoint_without_a_model_says_to_name_one(cast):
    endpoint = judges.judge_endpoint_create(team=cast.alpha, name="bare", base_url="http://127.0.0.1:9/v1")
    page = client_for(cast.alice).post(f"/team/judge-endpoints/{endpoint.pk}/test", follow=True)
    assert "no default model" in page.content.decode()


def test_rotate_key_replaces_the_stored_key(cast):
    with openai_stub(["OK"]) as stub:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=stub.url, api_key="sk-old", default_model="m"
        )
        client = client_for(cast.alice)
        assert (
            client.post(f"/team/judge-endpoints/{endpoint.pk}/rotate", {"api_key": "sk-new"}).status_code
            == 302
        )
        endpoint.refresh_from_db()
        assert secrets.decrypt(endpoint.api_key_encrypted) == "sk-new"
        client.post(f"/team/judge-endpoints/{endpoint.pk}/test")
        assert stub.headers[0]["Authorization"] == "Bearer sk-new"


def test_viewers_read_but_cannot_write_and_outsiders_get_404(cast):
    endpoint = judges.judge_endpoint_create(
        team=cast.alpha, name="writer", base_url="http://127.0.0.1:9/v1", api_key="sk-old", default_model="m"
    )
    bob, charlie = client_for(cast.bob), client_for(cast.charlie)
    listing = bob.get("/team/judge-endpoints")
    assert listing.status_code == 200 and 'data-judge="writer"' in listing.content.decode()
    assert "Rotate key" not in listing.content.decode()
    assert bob.post(f"/team/judge-endpoints/{endpoint.pk}/rotate", {"api_key": "x"}).status_code == 403
    assert (
        bob.post("/team/judge-endpoints", {"name": "y", "base_url": "http://127.0.0.1:9/v1"}).status_code
        == 403
    )
    assert 'data-judge="writer"' not in charlie.get("/team/judge-endpoints").content.decode()
    for action in ("test", "rotate"):
        assert (
            charlie.post(f"/team/judge-endpoints/{endpoint.pk}/{action}", {"api_key": "x"}).status_code == 404
        )
    endpoint.refresh_from_db()
    assert secrets.decrypt(endpoint.api_key_encrypted) == "sk-old"


def test_a_loopback_base_url_says_how_an_operator_allows_it(cast, settings):
    settings.OUTBOUND_ALLOW = ()  # the tests' autouse fixture allows loopback
    page = client_for(cast.alice).post(
        "/team/judge-endpoints", {"name": "local", "base_url": "http://127.0.0.1:8000/v1", "timeout_s": "5"}
    )
    assert page.status_code == 200 and not JudgeEndpoint.objects.exists()
    (error,) = page.context["form"].errors["base_url"]
    assert "127.0.0.1 is a loopback address" in error
    assert "adding 127.0.0.1:8000 to the OUTBOUND_ALLOW setting" in error, error
    assert "OUTBOUND_ALLOW" in page.content.decode()  # shown next to the field
