""" "Test connection" for a judge endpoint stored with a non-ASCII host (a row written before writes
were IDNA-encoded): the call goes to the IDNA name, or the page shows why it cannot, never a 500."""

from __future__ import annotations

import pytest

from projects.models import JudgeEndpoint
from projects.services import judges
from tests.frontend.test_views import client_for
from tests.listener import FakeDNS
from tests.openai_stub import openai_stub

pytestmark = pytest.mark.django_db

PUNYCODE_HOST = "xn--r8jz45g.xn--zckzah"  # 例え.テスト


def test_test_connection_reaches_a_stored_non_ascii_host_by_its_idna_name(cast, monkeypatch):
    FakeDNS(monkeypatch).add(PUNYCODE_HOST, "127.0.0.1")  # loopback is allow-listed in tests
    with openai_stub(["OK"]) as stub:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=stub.url, api_key="sk-test", default_model="m"
        )
        port = stub.url.split(":")[2].split("/")[0]
        JudgeEndpoint.objects.filter(pk=endpoint.pk).update(base_url=f"http://例え.テスト:{port}/v1")
        page = client_for(cast.alice).post(f"/team/judge-endpoints/{endpoint.pk}/test")
        assert page.status_code == 200
        assert page.context["check"].ok, page.context["check"]
        assert stub.headers[0]["Host"] == f"{PUNYCODE_HOST}:{port}"


def test_test_connection_to_a_stored_invalid_idna_host_shows_the_reason(cast):
    endpoint = judges.judge_endpoint_create(
        team=cast.alpha, name="writer", base_url="https://judge.invalid/v1", default_model="m"
    )
    JudgeEndpoint.objects.filter(pk=endpoint.pk).update(base_url="https://☃.example/v1")
    page = client_for(cast.alice).post(f"/team/judge-endpoints/{endpoint.pk}/test")
    assert page.status_code == 200
    check = page.context["check"]
    assert not check.ok and "the host is not a valid name" in check.detail
    assert 'data-ok="0"' in page.content.decode()
