"""The DEBUG error page (and every error report) never shows a credential held in a URL."""

import sys

from django.test import RequestFactory, override_settings
from django.views.debug import ExceptionReporter, technical_500_response

from artweb.error_reports import CredentialMaskingReporterFilter, mask_url_credentials

# Spelled in two pieces: the page quotes the source lines around each frame, this file's included.
SECRET = "pa55" + "word"
DATABASE_URL = f"postgres://artweb:db-{SECRET}@db.internal:5432/artweb"
BROKER_URL = f"redis://:broker-{SECRET}@redis.internal:6379/0"
OTHER_URL = f"amqp://worker:other-{SECRET}@rabbit.internal//"


def _technical_500_html(**meta):
    request = RequestFactory().get("/projects/", **meta)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        exc_type, exc_value, traceback = sys.exc_info()
    response = technical_500_response(request, exc_type, exc_value, traceback)
    reporter_text = ExceptionReporter(request, exc_type, exc_value, traceback).get_traceback_text()
    return response.content.decode(), reporter_text


@override_settings(
    DEBUG=True,
    DATABASE_URL=DATABASE_URL,
    CELERY_BROKER_URL=BROKER_URL,
    CELERY_RESULT_BACKEND=OTHER_URL,  # not named like a URL: masked inside the value
    ARTWEB_EXTRA={"upstreams": [OTHER_URL]},
)
def test_debug_error_page_shows_no_url_credentials():
    html, text = _technical_500_html(DATABASE_URL=DATABASE_URL, HTTP_X_UPSTREAM=OTHER_URL)
    for page in (html, text):
        assert "RuntimeError" in page
        for password in ("db-", "broker-", "other-"):
            assert password + SECRET not in page
    # Still useful for debugging: where the result backend points, without who logs in.
    assert "amqp://********@rabbit.internal//" in text


def test_url_and_dsn_settings_are_hidden_and_userinfo_masked_anywhere():
    report_filter = CredentialMaskingReporterFilter()
    hidden = report_filter.cleansed_substitute
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "SENTRY_DSN", "MONGO_URI", "ALLOWED_URLS"):
        assert report_filter.cleanse_setting(name, "scheme://host/") == hidden
    for name in ("SECURITY_LEVEL", "CURIOUS", "DEBUG"):
        assert report_filter.cleanse_setting(name, "plain") == "plain"
    assert report_filter.cleanse_setting("BACKENDS", {"a": [OTHER_URL]}) == {
        "a": ["amqp://********@rabbit.internal//"]
    }


def test_mask_url_credentials_keeps_urls_without_userinfo():
    assert mask_url_credentials("see https://example.com/a@b and redis://u:p@h:1/0") == (
        "see https://example.com/a@b and redis://********@h:1/0"
    )
    assert mask_url_credentials("mailto:someone@example.com") == "mailto:someone@example.com"
