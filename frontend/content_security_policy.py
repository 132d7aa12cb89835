"""The dashboard's Content-Security-Policy: only this origin's scripts, styles and requests.

Every script is a file under frontend/static (htmx and Chart.js are vendored, served by whitenoise),
and the templates hold no inline script, event handler or style attribute, so the policy needs no
nonce and no 'unsafe-inline'. htmx is configured (base.html's htmx-config meta) not to inject its
indicator <style> and never to eval. JSON endpoints (`/api/`, `/v1/`) get no policy: nothing renders
their bodies as a page.

Twenty lines of middleware rather than django-csp: the policy is one constant header (no nonces,
no per-view policies, no report endpoint), and Django 6 ships its own CSP middleware to move to
once the project can leave the 5.2 line.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",  # the blank favicon is a data: URL
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
UNCOVERED_PREFIXES = ("/api/", "/v1/")


class ContentSecurityPolicyMiddleware:
    """Sets POLICY on every dashboard response (any path outside UNCOVERED_PREFIXES) that has none."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if not request.path_info.startswith(UNCOVERED_PREFIXES):
            response.headers.setdefault("Content-Security-Policy", POLICY)
        return response
