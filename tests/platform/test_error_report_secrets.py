"""The DEBUG error page (and every error report) never shows a decrypted team secret: a 500 raised
while a judge key is on the stack renders a page, HTML and text alike, without the key or its
``Authorization: Bearer …`` header, and the filter's rules (secret-named locals and keys, ``headers``
mappings, ``Bearer`` values, secret-named POST fields) hold for any frame."""

from __future__ import annotations

import sys

import pytest
from django.test import Client, RequestFactory
from django.views.debug import ExceptionReporter

from artweb.error_reports import CredentialMaskingReporterFilter
from projects.services import judges, webhooks
from training.safety.outbound import OutboundPolicy

pytestmark = pytest.mark.django_db

# Spelled in pieces: the page quotes the source lines around each frame, this file's included.
JUDGE_KEY = "sk-live-" + "judge" + "7f3a9c2e"
MCP_HEADER = "mcp-" + "header" + "-51c0ffee"


def _fail_at_connect(self, address, *args, **kwargs):
    raise RuntimeError("boom at connect")  # not an OSError: nothing below the view handles it


@pytest.fixture
def failing_judge(cast, settings, monkeypatch):
    settings.DEBUG = True
    endpoint = judges.judge_endpoint_create(
        team=cast.alpha, name="writer", base_url="http://127.0.0.1:9/v1", api_key=JUDGE_KEY, default_model="m"
    )
    # Raised inside http.client, after the Authorization header was built from the decrypted key.
    monkeypatch.setattr(OutboundPolicy, "create_connection", _fail_at_connect)
    client = Client(raise_request_exception=False)
    client.force_login(cast.alice)
    return client, endpoint


@pytest.mark.parametrize("accept", ["text/html", "text/plain"])
def test_a_500_during_test_connection_shows_no_judge_key(failing_judge, accept):
    client, endpoint = failing_judge
    page = client.post(f"/team/judge-endpoints/{endpoint.pk}/test", HTTP_ACCEPT=accept)
    assert page.status_code == 500
    text = page.content.decode()
    # The page still renders, with the frames that held the key.
    assert "boom at connect" in text and "post_chat_completion" in text and "_send_request" in text
    assert accept in page["Content-Type"]
    assert JUDGE_KEY not in text
    assert "Bearer " + JUDGE_KEY[:8] not in text
    assert "Bearer ********" in text or "********************" in text


def test_the_report_of_the_same_failure_holds_no_key(failing_judge):
    """The e-mail report (ExceptionReporter's text) goes through the same filter."""
    _, endpoint = failing_judge
    request = RequestFactory().post("/team/judge-endpoints/x/test")
    try:
        judges.judge_endpoint_test(endpoint=endpoint)
    except RuntimeError:
        reporter = ExceptionReporter(request, *sys.exc_info())
    html, text = reporter.get_traceback_html(), reporter.get_traceback_text()
    for report in (html, text):
        assert "boom at connect" in report and JUDGE_KEY not in report


def _frame_with(**values):
    def frame(**locals_):
        return sys._getframe()

    return frame(**values)


def _shown(filter_, **values) -> dict[str, str]:
    request = RequestFactory().get("/")
    return {
        name: repr(value)
        for name, value in filter_.get_traceback_frame_variables(request, _frame_with(**values))
    }


def test_secret_locals_keys_headers_and_bearer_values_are_masked_and_the_rest_kept():
    shown = _shown(
        CredentialMaskingReporterFilter(),
        locals_={
            "api_key": JUDGE_KEY,  # a local named like a secret (training's convention)
            "settings_of_endpoint": {"api_key": JUDGE_KEY, "model": "judge-model"},
            "headers": {"X-Team": MCP_HEADER, "Content-Type": "application/json"},
            "config": {"url": "https://mcp.example/mcp", "headers": {"X-Team": MCP_HEADER}},
            "values": (b"Bearer " + JUDGE_KEY.encode(),),  # http.client's putheader
            "hdrs": {"Authorization": JUDGE_KEY, "X-Api-Key": JUDGE_KEY},
            "max_tokens": 8,
            "model": "judge-model",
        },
    )
    text = " ".join(shown.values())
    assert JUDGE_KEY not in text and MCP_HEADER not in text
    assert "judge-model" in text and "https://mcp.example/mcp" in text and "Content-Type" in text
    assert "8" in text


def test_sensitive_variables_apply_on_the_debug_page_too(settings):
    settings.DEBUG = True
    assert CredentialMaskingReporterFilter().is_active(RequestFactory().get("/"))


def test_a_secret_named_post_field_is_masked(settings):
    settings.DEBUG = True
    request = RequestFactory().post("/team/judge-endpoints", {"name": "j", "api_key": JUDGE_KEY})
    posted = CredentialMaskingReporterFilter().get_post_parameters(request)
    assert posted["name"] == "j" and posted["api_key"] != JUDGE_KEY


def _report_of_attempt(delivery_id: int) -> tuple[str, str]:
    # Caught here, not in the test: the test's own frame (which holds the secret) is no part of it.
    try:
        webhooks.webhook_attempt(delivery_id=delivery_id)
    except RuntimeError:
        reporter = ExceptionReporter(RequestFactory().get("/"), *sys.exc_info())
    return reporter.get_traceback_html(), reporter.get_traceback_text()


def test_the_webhook_signing_secret_is_masked_in_its_frames(cast, settings, monkeypatch):
    settings.DEBUG = True
    created = webhooks.webhook_endpoint_create(
        team=cast.alpha, name="ci", url="http://127.0.0.1:9/h", events=["*"]
    )
    assert created.secret not in repr(created)  # a view's local after a create
    monkeypatch.setattr(webhooks, "_enqueue", lambda delivery_id: None)
    monkeypatch.setattr(OutboundPolicy, "create_connection", _fail_at_connect)
    delivery = webhooks.webhook_test(endpoint=created.endpoint)
    html, text = _report_of_attempt(delivery.pk)
    for report in (html, text):
        assert "boom at connect" in report and "webhook_attempt" in report
        assert created.secret not in report
