"""A project description's `code` spans are shown as code, not with their backticks, and the rest
of the user's text stays escaped (the demo project's description read `make up` literally)."""

from __future__ import annotations

import pytest

from tests.frontend.test_views import client_for

pytestmark = pytest.mark.django_db


def test_backtick_spans_become_code_and_the_text_stays_escaped(cast, alpha_setup):
    project = alpha_setup.project
    project.description = "Started by `make up` <script>alert(1)</script> & `a<b>`"
    project.save()
    client = client_for(cast.alice)
    for url in (f"/projects/{project.pk}/", "/projects/"):
        html = client.get(url).content.decode()
        assert "Started by <code>make up</code> &lt;script&gt;alert(1)&lt;/script&gt; &amp; " in html, url
        assert "<code>a&lt;b&gt;</code>" in html and "`make up`" not in html, url
