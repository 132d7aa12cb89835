"""The reward editor after a refused save, in Chromium: each problem is listed once (the server's
list after the submit and the live check as you type said the same line twice)."""

from __future__ import annotations

import pytest

from tests.browser.test_charts import setup, sign_in, web  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_a_refused_spec_lists_each_problem_once(browser, web, setup):  # noqa: F811
    sign_in(browser, web)
    page = browser.page
    page.goto(f"{web.url}/rewards/{setup.reward.pk}/")
    page.fill("textarea[name=spec]", '{"type": "regex"}')
    page.click("form[data-grader-editor] button[type=submit]")
    page.wait_for_selector("[data-validation].invalid li")
    lines = page.locator("form[data-grader-editor] li").all_inner_texts()
    assert len([line for line in lines if "pattern" in line]) == 1, lines
    # Editing the spec leaves only the live check's answer.
    page.fill("textarea[name=spec]", '{"type": "regex", "pattern": "4"}')
    page.wait_for_selector("[data-validation].valid")
    assert page.locator("form[data-grader-editor] li").all_inner_texts() == []
    assert browser.console_errors == []
