"""What Django's error reports (the DEBUG technical 500 page, the error e-mails) may show.

Invariant: no credential reaches a rendered report, whatever the setting or variable is called.

Django's own filter hides settings whose names look secret (KEY, TOKEN, PASS, ...), but
`DATABASE_URL` and `CELERY_BROKER_URL` carry their password inside the URL, and a WSGI server's
`request.META` carries the whole process environment. This filter also hides every setting or META
entry named like a URL or DSN, and masks the `user:password@` part of any URL in any value
(settings, META, and the traceback's local variables).

The traceback's locals hold decrypted team secrets while a judge, webhook or MCP call is on the
stack (a judge key, `Authorization: Bearer …`, MCP header values). Django applies
`sensitive_variables` only when DEBUG is off, which leaves the DEBUG page showing them; this filter
applies it always, and masks by convention too, because `training/` (no Django) cannot use the
decorator: a local or mapping key named like a secret (`api_key`, `key`, `secret`, `token`,
`Authorization`, …; `SECRET_NAME`), every value of a mapping named `headers` (MCP header values
are all write-only), and `Bearer …` anywhere in a value. POST fields named like a secret (the
judge form's `api_key`) are masked as well.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from django.template.defaultfilters import pprint
from django.utils.datastructures import MultiValueDict
from django.views.debug import SafeExceptionReporterFilter

# Django's list, plus names of connection strings (DATABASE_URL, CELERY_BROKER_URL, SENTRY_DSN,
# *_URI); `_`-delimited so that SECURITY or CURIOUS do not match URI.
HIDDEN_SETTINGS = re.compile(
    r"API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE|(?:^|_)(?:URLS?|URIS?|DSNS?)(?:_|$)",
    flags=re.IGNORECASE,
)
# scheme://userinfo@ — the userinfo (a user, or user:password) of any URL in a string.
URL_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)[^/\s@?#]+@", flags=re.IGNORECASE)
# A name (local variable, mapping key, POST field) whose value is a secret: one of these words,
# delimited by anything but a letter or digit (`api_key`, `X-Api-Key`, `secret_encrypted`,
# `HTTP_AUTHORIZATION`); `max_tokens` or `monkey` are not.
SECRET_NAME = re.compile(
    r"(?:^|[^a-z0-9])(?:api[-_]?key|apikey|key|secret|token|password|passwd|pwd|authorization|auth"
    r"|cookie|signature|credentials?|bearer)(?:[^a-z0-9]|$)",
    flags=re.IGNORECASE,
)
# `Bearer <token>` in any text, a bytes repr (`b'Bearer sk-…'`) included.
BEARER = re.compile(r"(?P<scheme>\bbearer\s+)[^\s'\",;]+", flags=re.IGNORECASE)
HEADERS_NAME = "headers"
MASK = "********"


def mask_url_credentials(text: str, substitute: str = MASK) -> str:
    """`text` with the `user:password@` of every URL in it replaced by `substitute@`."""
    return URL_USERINFO.sub(lambda match: f"{match['scheme']}{substitute}@", text)


def mask_bearer_tokens(text: str, substitute: str = MASK) -> str:
    """`text` with the token of every `Bearer <token>` in it replaced by `substitute`."""
    return BEARER.sub(lambda match: f"{match['scheme']}{substitute}", text)


def is_secret_name(name: Any) -> bool:
    return isinstance(name, str | bytes) and bool(
        SECRET_NAME.search(name.decode("latin-1") if isinstance(name, bytes) else name)
    )


class CredentialMaskingReporterFilter(SafeExceptionReporterFilter):
    """DEFAULT_EXCEPTION_REPORTER_FILTER: Django's filter, hiding URL/DSN settings as well, masking
    credentials inside any URL of any setting or META value, and secrets in the traceback's locals
    and the POST data, on the DEBUG page too (see the module docstring)."""

    hidden_settings = HIDDEN_SETTINGS

    def is_active(self, request: Any) -> bool:
        # Django's default (only when DEBUG is off) is what let the DEBUG page show a judge key.
        return True

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        if isinstance(cleansed, str):
            return mask_bearer_tokens(mask_url_credentials(cleansed))
        return cleansed

    def get_post_parameters(self, request: Any) -> Any:
        return self._cleansed_multivaluedict(super().get_post_parameters(request))

    def get_traceback_frame_variables(self, request: Any, tb_frame: Any) -> Any:
        variables = super().get_traceback_frame_variables(request, tb_frame)
        return [(name, self._masked_for_report(name, value)) for name, value in variables]

    def _masked_for_report(self, name: str, value: Any) -> Any:
        if value is self.cleansed_substitute:  # sensitive_variables already hid it
            return value
        if is_secret_name(name):
            return self.cleansed_substitute
        cleansed = self._cleansed(value, all_values=name == HEADERS_NAME)
        shown = pprint(cleansed)
        masked = mask_bearer_tokens(mask_url_credentials(shown))
        return value if cleansed is value and masked == shown else _Shown(masked)

    def _cleansed(self, value: Any, *, all_values: bool = False, depth: int = 0) -> Any:
        """``value`` itself when nothing in it is secret; otherwise a copy (dicts, lists and tuples,
        a few levels deep) with the values of secret-named keys replaced (all values under a
        ``headers`` key, or when ``all_values``)."""
        if depth > 4:
            return value
        try:
            if isinstance(value, MultiValueDict):
                return self._cleansed_multivaluedict(value)
            if isinstance(value, Mapping):
                mapping = {
                    key: self.cleansed_substitute
                    if all_values or is_secret_name(key)
                    else self._cleansed(item, all_values=key == HEADERS_NAME, depth=depth + 1)
                    for key, item in value.items()
                }
                unchanged = all(mapping[key] is item for key, item in value.items())
                return value if unchanged else mapping
            if isinstance(value, list | tuple):
                items = [self._cleansed(item, depth=depth + 1) for item in value]
                if all(new is old for new, old in zip(items, value, strict=True)):
                    return value
                return items if isinstance(value, list) else tuple(items)
        except Exception:  # a mapping whose items() fails: shown as its repr, masked as text
            return value
        return value

    def _cleansed_multivaluedict(self, value: Any) -> Any:
        if not isinstance(value, MultiValueDict) or not any(is_secret_name(key) for key in value):
            return value
        value = value.copy()
        for key in list(value):
            if is_secret_name(key):
                value.setlist(key, [self.cleansed_substitute])
        return value


class _Shown:
    """A local variable as the report will print it (the report pprints what the filter returns)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text
