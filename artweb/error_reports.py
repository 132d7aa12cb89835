"""What Django's error reports (the DEBUG technical 500 page, the error e-mails) may show.

Django's own filter hides settings whose names look secret (KEY, TOKEN, PASS, ...), but
`DATABASE_URL` and `CELERY_BROKER_URL` carry their password inside the URL, and a WSGI server's
`request.META` carries the whole process environment. This filter also hides every setting or META
entry named like a URL or DSN, and masks the `user:password@` part of any URL in any value
(settings, META, and the traceback's local variables), so no credential reaches a rendered report
whatever the setting or variable is called.
"""

from __future__ import annotations

import re
from typing import Any

from django.template.defaultfilters import pprint
from django.views.debug import SafeExceptionReporterFilter

# Django's list, plus names of connection strings (DATABASE_URL, CELERY_BROKER_URL, SENTRY_DSN,
# *_URI); `_`-delimited so that SECURITY or CURIOUS do not match URI.
HIDDEN_SETTINGS = re.compile(
    r"API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|(?:^|_)(?:URLS?|URIS?|DSNS?)(?:_|$)",
    flags=re.IGNORECASE,
)
# scheme://userinfo@ — the userinfo (a user, or user:password) of any URL in a string.
URL_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)[^/\s@?#]+@", flags=re.IGNORECASE)


def mask_url_credentials(text: str, substitute: str = "********") -> str:
    """`text` with the `user:password@` of every URL in it replaced by `substitute@`."""
    return URL_USERINFO.sub(lambda match: f"{match['scheme']}{substitute}@", text)


class CredentialMaskingReporterFilter(SafeExceptionReporterFilter):
    """DEFAULT_EXCEPTION_REPORTER_FILTER: Django's filter, hiding URL/DSN settings as well and
    masking credentials inside any URL of any setting or META value (see the module docstring)."""

    hidden_settings = HIDDEN_SETTINGS

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        if isinstance(cleansed, str):
            return mask_url_credentials(cleansed)
        return cleansed

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> Any:
        variables = super().get_traceback_frame_variables(request, tb_frame)
        return [(name, _masked_for_report(value)) for name, value in variables]


class _Shown:
    """A local variable as the report will print it (the report pprints what the filter returns)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _masked_for_report(value: Any) -> Any:
    shown = pprint(value)
    masked = mask_url_credentials(shown)
    return value if masked == shown else _Shown(masked)
