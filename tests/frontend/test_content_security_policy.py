"""The dashboard's Content-Security-Policy: on every dashboard page, not on the JSON APIs, and
the templates hold nothing the policy would block (inline scripts, event handlers, style attributes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client

from frontend.content_security_policy import POLICY

pytestmark = pytest.mark.django_db

TEMPLATES = Path(__file__).resolve().parents[2] / "frontend" / "templates"


def _directives(header: str) -> dict[str, str]:
    return dict(part.strip().split(" ", 1) for part in header.split(";"))


def test_dashboard_pages_carry_the_policy(cast):
    client = Client()
    client.force_login(cast.alice)
    for path in ("/login/", "/projects/", "/team/members", "/no-such-page/"):
        response = client.get(path)
        directives = _directives(response["Content-Security-Policy"])
        assert directives["default-src"] == "'self'" and directives["script-src"] == "'self'"
        assert directives["object-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
        assert directives["base-uri"] == "'self'" and directives["form-action"] == "'self'"
        assert "unsafe" not in response["Content-Security-Policy"]


def test_api_and_gateway_responses_need_no_policy(cast):
    for path in ("/api/v1/projects/", "/v1/models"):
        response = Client().get(path)
        assert response["Content-Type"].startswith("application/json")
        assert "Content-Security-Policy" not in response


def test_policy_is_the_documented_constant():
    assert POLICY.startswith("default-src 'self'; script-src 'self'; style-src 'self'")


def test_templates_hold_nothing_the_policy_blocks():
    inline_script = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>", re.IGNORECASE)
    event_handler = re.compile(r"\son[a-z]+\s*=", re.IGNORECASE)
    style_attribute = re.compile(r"\sstyle\s*=", re.IGNORECASE)
    problems = []
    for template in sorted(TEMPLATES.rglob("*.html")):
        text = template.read_text(encoding="utf-8")
        for name, pattern in (
            ("inline <script>", inline_script),
            ("event handler attribute", event_handler),
            ("style attribute", style_attribute),
        ):
            problems += [f"{template.name}: {name} {match.group(0)!r}" for match in pattern.finditer(text)]
        if "<style" in text or "javascript:" in text:
            problems.append(f"{template.name}: inline <style> or javascript: URL")
    assert problems == []
