"""Cursors of every list (projects.api.pagination): ``after=0`` is the start, as the README's
quickstart polls events; an id below an event list's first is the start too (it skips nothing);
any other id the list never handed out stays a 400 naming ``after``."""

from __future__ import annotations

import pytest

from tests import factories
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


def _run(key_client, setup, model) -> int:
    body = {"model": model.pk, "task_set": setup.task_set.pk, "environment": setup.environment.pk,
            "reward": setup.reward.pk, "config": {"steps": 1}}  # fmt: skip
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()["id"]


def _ids(response) -> list[int]:
    assert response.status_code == 200, response.json()
    return [item["id"] for item in response.json()["data"]]


@pytest.fixture
def two_runs(alpha_setup, key_client):
    """Runs a and b on two models, their events interleaved: a1 < b1 < a2 (a cancelled after b)."""
    other = factories.TrainableModelFactory(
        project=alpha_setup.project, name="second", base_model=alpha_setup.base
    )
    a = _run(key_client, alpha_setup, alpha_setup.model)
    b = _run(key_client, alpha_setup, other)
    assert key_client.post(f"/api/v1/runs/{a}/cancel/").status_code == 200
    return a, b


def test_after_zero_is_the_start_of_the_readme_s_event_poll(two_runs, key_client):
    a, _b = two_runs
    everything = _ids(key_client.get(f"/api/v1/runs/{a}/events/"))
    assert len(everything) == 2
    assert _ids(key_client.get(f"/api/v1/runs/{a}/events/?after=0")) == everything
    # …and then the documented next call: the last id seen.
    assert _ids(key_client.get(f"/api/v1/runs/{a}/events/?after={everything[0]}")) == everything[1:]


def test_after_zero_is_the_start_of_lists_in_other_orders(two_runs, key_client):
    newest_first = _ids(key_client.get("/api/v1/runs/"))
    assert newest_first == sorted(newest_first, reverse=True) and len(newest_first) == 2
    assert _ids(key_client.get("/api/v1/runs/?after=0")) == newest_first
    assert _ids(key_client.get("/api/v1/runs/?after=0&limit=1")) == newest_first[:1]
    by_name = _ids(key_client.get("/api/v1/base-models/"))
    assert by_name and _ids(key_client.get("/api/v1/base-models/?after=0")) == by_name


def test_an_id_below_an_event_lists_first_is_its_start(two_runs, key_client):
    a, b = two_runs
    first_of_a = _ids(key_client.get(f"/api/v1/runs/{a}/events/"))[0]
    events_of_b = _ids(key_client.get(f"/api/v1/runs/{b}/events/"))
    assert first_of_a < events_of_b[0]
    assert _ids(key_client.get(f"/api/v1/runs/{b}/events/?after={first_of_a}")) == events_of_b


def test_an_unknown_cursor_that_would_skip_rows_is_still_a_400(two_runs, key_client):
    a, b = two_runs
    events_of_a = _ids(key_client.get(f"/api/v1/runs/{a}/events/"))
    first_of_b = _ids(key_client.get(f"/api/v1/runs/{b}/events/"))[0]
    assert events_of_a[0] < first_of_b < events_of_a[1]
    for after in (first_of_b, events_of_a[-1] + 1000):  # inside the list, past its end
        response = key_client.get(f"/api/v1/runs/{a}/events/?after={after}")
        assert response.status_code == 400, response.json()
        assert error_of(response)["param"] == "after"
        assert f"no item with id {after}" in error_of(response)["message"]
    # In an order that is not by id, no unknown id has a place.
    response = key_client.get(f"/api/v1/runs/?after={max(a, b) + 1000}")
    assert response.status_code == 400 and error_of(response)["param"] == "after"
