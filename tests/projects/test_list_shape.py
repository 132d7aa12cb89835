"""Every list is OpenAI's list object with keyset pagination (``after``, ``limit``, ``has_more``,
``first_id``, ``last_id``), in the list's own order, with bad cursors refused as 400s."""

from __future__ import annotations

import pytest

from projects import services

pytestmark = pytest.mark.django_db


def _walk(client, url: str, limit: int) -> list[dict]:
    """Every item of a list, page by page, checking each page's cursor fields."""
    items, after = [], None
    while True:
        page = client.get(url, {"limit": limit, **({"after": after} if after else {})}).json()
        assert page["object"] == "list" and len(page["data"]) <= limit
        if page["data"]:
            assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        else:
            assert page["first_id"] is None and page["last_id"] is None
        items += page["data"]
        if not page["has_more"]:
            return items
        after = page["last_id"]


def test_pages_follow_a_non_id_order_without_gaps_or_repeats(alpha_setup, key_client):
    # Checkpoints list by step; recorded out of step order, so id order and list order differ.
    for step in (3, 0, 2, 1, 4):
        services.checkpoint_record(model=alpha_setup.model, run=None, step=step, path=f"/nowhere/{step}")
    url = f"/api/v1/models/{alpha_setup.model.id}/checkpoints/"
    whole = key_client.get(url).json()["data"]
    assert [c["step"] for c in whole] == [0, 1, 2, 3, 4]
    for limit in (1, 2, 3):
        assert [c["step"] for c in _walk(key_client, url, limit)] == [0, 1, 2, 3, 4], limit


def _pages(queryset, limit: int) -> list[str]:
    from rest_framework.request import Request
    from rest_framework.test import APIRequestFactory

    from projects.api.pagination import page_of

    names, after = [], None
    while True:
        query = {"limit": limit, **({"after": after} if after else {})}
        page, has_more = page_of(queryset, Request(APIRequestFactory().get("/", query)))
        names += [project.name for project in page]
        if not has_more:
            return names
        after = page[-1].pk


def test_pages_follow_descending_and_tied_orders(cast):
    from projects.models import Project

    for name in ("b", "a", "c", "a2"):
        services.project_create(team=cast.alpha, name=name, description="same" if name != "c" else "other")
    newest_first = Project.objects.filter(team=cast.alpha).order_by("-id")
    by_description_then_name = Project.objects.filter(team=cast.alpha).order_by("-description", "name")
    for limit in (1, 2, 3):
        assert _pages(newest_first, limit) == ["a2", "c", "a", "b"]
        assert _pages(by_description_then_name, limit) == ["a", "a2", "b", "c"]


@pytest.mark.parametrize(
    "query, field",
    [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=x", "limit"),
        (f"limit={2**63}", "limit"),
        ("after=999999", "after"),
        (f"after={2**64}", "after"),
        ("after=abc", "after"),
    ],
)
def test_bad_cursor_or_limit_is_a_400_naming_it(alpha_setup, key_client, query, field):
    response = key_client.get(f"/api/v1/projects/?{query}")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == field


def test_another_teams_id_is_not_a_cursor(alpha_setup, key_client, cast):
    theirs = services.project_create(team=cast.beta, name="theirs")
    response = key_client.get(f"/api/v1/projects/?after={theirs.id}")
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"
