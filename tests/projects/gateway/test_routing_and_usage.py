"""Model ids, team scoping, live-server choice, usage records and /api/v1/usage, rate limit counting."""

from __future__ import annotations

from datetime import date, timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from projects import services
from projects.gateway import routing
from projects.gateway.ratelimit import rate_limit_hit
from projects.gateway.services import inference_server_deregister, inference_server_heartbeat, usage_record
from projects.models import Checkpoint, InferenceServer, UsageRecord
from projects.selectors.serving import ModelNotFound, live_servers, resolve_model


@pytest.fixture
def checkpoints(alpha_setup):
    model = alpha_setup.model
    for step in (0, 1, 2):
        services.checkpoint_record(
            model=model, run=None, step=step, path=f"/ckpt/model-{model.pk}/step-{step}"
        )
    return alpha_setup


def test_model_ids_resolve_to_the_teams_checkpoints(checkpoints, cast):
    latest = resolve_model(team=cast.alpha, model_id="math/agent:latest")
    assert (latest.model_id, latest.checkpoint.step) == ("math/agent:2", 2)
    assert latest.adapter_path.endswith("step-2")
    assert resolve_model(team=cast.alpha, model_id="math/agent").model_id == "math/agent:2"
    assert resolve_model(team=cast.alpha, model_id="math/agent:1").checkpoint.step == 1
    base = resolve_model(team=cast.alpha, model_id="tiny")
    assert (base.model_id, base.checkpoint, base.adapter_path) == ("tiny", None, None)


@pytest.mark.parametrize("model_id", ["math/agent:9", "math/other:latest", "nope", "math/agent:x"])
def test_unknown_models_are_not_found(checkpoints, cast, model_id):
    with pytest.raises(ModelNotFound):
        resolve_model(team=cast.alpha, model_id=model_id)


def test_another_teams_checkpoint_reads_as_not_found(checkpoints, cast):
    with pytest.raises(ModelNotFound) as error:
        resolve_model(team=cast.beta, model_id="math/agent:latest")
    assert error.value.status_code == 404
    assert "does not exist or you do not have access" in error.value.message
    ids = [model["id"] for model in routing.available_models(team=cast.beta)]
    assert ids == ["tiny"]  # base models are shared; alpha's checkpoints are not listed
    alpha_ids = {model["id"] for model in routing.available_models(team=cast.alpha)}
    assert {"math/agent:0", "math/agent:2", "math/agent:latest"} <= alpha_ids


def test_model_list_gives_each_checkpoint_its_created_second(checkpoints, cast):
    """``created`` is the checkpoint's Unix second (PostgreSQL computes it; see team_checkpoint_names),
    and ``:latest`` is the newest checkpoint's."""
    moment = timezone.now().replace(microsecond=999_999)
    for step in (0, 1, 2):
        Checkpoint.objects.filter(model=checkpoints.model, step=step).update(
            created_at=moment + timedelta(days=step)
        )
    created = {model["id"]: model["created"] for model in routing.available_models(team=cast.alpha)}
    expected = {f"math/agent:{step}": int((moment + timedelta(days=step)).timestamp()) for step in (0, 1, 2)}
    assert {key: created[key] for key in expected} == expected
    assert created["math/agent:latest"] == expected["math/agent:2"]
    assert all(type(value) is int for value in created.values())


def test_only_servers_with_a_fresh_heartbeat_are_routed_to(checkpoints, settings):
    settings.INFERENCE_HEARTBEAT_TIMEOUT_S = 10
    inference_server_heartbeat(url="http://a:1", base_model_name="tiny")
    inference_server_heartbeat(url="http://b:1", base_model_name="tiny")
    InferenceServer.objects.filter(url="http://b:1").update(
        heartbeat_at=timezone.now() - timedelta(seconds=30)
    )
    base = checkpoints.base
    assert [s.url for s in live_servers(base_model=base, affinity="x")] == ["http://a:1"]
    inference_server_heartbeat(url="http://b:1", base_model_name="tiny")  # it came back
    assert len(live_servers(base_model=base, affinity="x")) == 2
    inference_server_deregister(url="http://a:1")
    assert [s.url for s in live_servers(base_model=base, affinity="x")] == ["http://b:1"]


def test_a_checkpoint_sticks_to_one_server_among_many(checkpoints):
    for index in range(4):
        inference_server_heartbeat(url=f"http://host{index}:8100", base_model_name="tiny")
    picks = {
        affinity: live_servers(base_model=checkpoints.base, affinity=affinity)[0].url
        for affinity in (f"/ckpt/{i}" for i in range(40))
    }
    assert picks == {
        affinity: live_servers(base_model=checkpoints.base, affinity=affinity)[0].url for affinity in picks
    }
    assert len(set(picks.values())) > 1  # and different checkpoints spread over the servers


def test_a_heartbeat_for_an_unknown_base_model_is_refused(db):
    from projects.errors import NotFound

    with pytest.raises(NotFound):
        inference_server_heartbeat(url="http://a:1", base_model_name="missing")


def test_usage_accumulates_per_key_model_and_day(checkpoints, cast):
    key = services.api_key_create(team=cast.alpha, name="app").api_key
    checkpoint = resolve_model(team=cast.alpha, model_id="math/agent:2").checkpoint
    usage_record(
        api_key=key, model="math/agent:2", checkpoint=checkpoint, prompt_tokens=10, completion_tokens=3
    )
    usage_record(
        api_key=key, model="math/agent:2", checkpoint=checkpoint, prompt_tokens=5, completion_tokens=1
    )
    usage_record(api_key=key, model="tiny", checkpoint=None, prompt_tokens=7, completion_tokens=2)
    usage_record(api_key=key, model="tiny", checkpoint=None, prompt_tokens=1, completion_tokens=1,
                 day=date(2026, 1, 1))  # fmt: skip
    row = UsageRecord.objects.get(model="math/agent:2")
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.team) == (2, 15, 4, cast.alpha)
    assert UsageRecord.objects.count() == 3


def test_usage_api_reports_by_day_and_model_for_the_callers_team_only(
    checkpoints, cast, key_client, charlie_client, bob_client
):
    key = services.api_key_create(team=cast.alpha, name="app").api_key
    usage_record(api_key=key, model="math/agent:2", checkpoint=None, prompt_tokens=10, completion_tokens=3)
    usage_record(api_key=key, model="tiny", checkpoint=None, prompt_tokens=7, completion_tokens=2)
    usage_record(api_key=key, model="tiny", checkpoint=None, prompt_tokens=1, completion_tokens=1,
                 day=date(2026, 1, 1))  # fmt: skip
    today = timezone.now().date().isoformat()

    body = key_client.get("/api/v1/usage").json()
    assert body["group_by"] == ["day", "model"]
    assert [(row["day"], row["model"], row["prompt_tokens"]) for row in body["data"]] == [
        ("2026-01-01", "tiny", 1), (today, "math/agent:2", 10), (today, "tiny", 7),
    ]  # fmt: skip
    assert body["totals"] == {"requests": 3, "prompt_tokens": 18, "completion_tokens": 6, "total_tokens": 24}

    by_model = key_client.get("/api/v1/usage", {"group_by": "model", "start": today}).json()["data"]
    assert [(row["model"], row["requests"], row["total_tokens"]) for row in by_model] == [
        ("math/agent:2", 1, 13), ("tiny", 1, 9),
    ]  # fmt: skip
    by_key = key_client.get("/api/v1/usage", {"group_by": "api_key"}).json()["data"]
    assert by_key == [{"api_key": key.prefix, "requests": 3, "prompt_tokens": 18, "completion_tokens": 6,
                       "total_tokens": 24}]  # fmt: skip
    assert bob_client.get("/api/v1/usage").json()["totals"]["requests"] == 3  # viewers may read
    assert charlie_client.get("/api/v1/usage").json() == {
        "object": "list", "group_by": ["day", "model"], "data": [],
        "has_more": False, "first_id": None, "last_id": None,
        "totals": {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }  # fmt: skip
    bad = key_client.get("/api/v1/usage", {"group_by": "colour"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"


def test_usage_api_needs_a_caller(anonymous_client):
    assert anonymous_client.get("/api/v1/usage").status_code in (401, 403)


def test_rate_limit_counts_per_key_in_fixed_minute_windows():
    cache.clear()
    start = 6000.0  # the start of a window
    assert [rate_limit_hit(api_key_id=1, limit_per_minute=2, now=start + i) for i in range(2)] == [None, None]
    assert (
        rate_limit_hit(api_key_id=1, limit_per_minute=2, now=start + 20) == 40
    )  # seconds to the next window
    assert rate_limit_hit(api_key_id=2, limit_per_minute=2, now=start + 20) is None  # another key
    assert rate_limit_hit(api_key_id=1, limit_per_minute=2, now=start + 60) is None  # a new window
    assert rate_limit_hit(api_key_id=1, limit_per_minute=0, now=start) is None  # 0 = unlimited
