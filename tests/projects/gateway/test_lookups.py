"""The gateway's short-lived lookup memory (projects.gateway.lookups): what it saves and the
documented lags it costs, on the gateway's own pre-forwarding step."""

from __future__ import annotations

import json
import time

import pytest

from projects import services
from projects.gateway import lookups
from projects.gateway.services import inference_server_heartbeat
from projects.gateway.views import GatewayError, _NotRemembered, _prepare_chat, _prepare_remembered


@pytest.fixture
def gateway_setup(alpha_setup, alpha_key, settings):
    settings.GATEWAY_LOOKUP_CACHE_S = 0.3
    settings.GATEWAY_RATE_LIMIT_PER_MINUTE = 0
    lookups.api_keys.clear()
    lookups.routes.clear()
    inference_server_heartbeat(url="http://a:1", base_model_name="tiny")
    yield alpha_setup
    lookups.api_keys.clear()
    lookups.routes.clear()


def body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_a_revoked_key_works_only_until_its_lookup_expires(
    gateway_setup, alpha_key, django_assert_num_queries
):
    authorization = f"Bearer {alpha_key}"
    _prepare_chat(authorization, body("tiny"))
    with django_assert_num_queries(0):  # remembered: no database round trip at all
        _prepare_chat(authorization, body("tiny"))
    key = services.api_key_authenticate(raw=alpha_key)
    services.api_key_revoke(api_key=key)
    _prepare_chat(authorization, body("tiny"))  # within the lag
    time.sleep(0.35)
    with pytest.raises(GatewayError) as error:
        _prepare_chat(authorization, body("tiny"))
    assert error.value.status == 401


def test_failures_are_not_remembered_and_a_new_checkpoint_is_latest_after_the_lag(gateway_setup, alpha_key):
    authorization = f"Bearer {alpha_key}"
    model = gateway_setup.model
    with pytest.raises(GatewayError) as error:
        _prepare_chat(authorization, body("math/agent:latest"))
    assert error.value.status == 404
    services.checkpoint_record(model=model, run=None, step=1, path="/ckpt/1")
    assert _prepare_chat(authorization, body("math/agent:latest")).target.model_id == "math/agent:1"
    services.checkpoint_record(model=model, run=None, step=2, path="/ckpt/2")
    assert _prepare_chat(authorization, body("math/agent:latest")).target.model_id == "math/agent:1"
    time.sleep(0.35)
    assert _prepare_chat(authorization, body("math/agent:latest")).target.model_id == "math/agent:2"


def test_zero_turns_the_memory_off(gateway_setup, alpha_key, settings, django_assert_num_queries):
    settings.GATEWAY_LOOKUP_CACHE_S = 0
    _prepare_chat(f"Bearer {alpha_key}", body("tiny"))
    with django_assert_num_queries(3):  # key, model, live servers
        _prepare_chat(f"Bearer {alpha_key}", body("tiny"))


def test_a_remembered_caller_is_routed_without_the_database_and_counted_once(
    gateway_setup, alpha_key, settings, django_assert_num_queries
):
    settings.GATEWAY_RATE_LIMIT_PER_MINUTE = 2
    # What is remembered, not for how long (the lag has its own test): the default 1 s memory
    # could lapse between two calls on a loaded machine (seen once in a fresh-clone CI run).
    settings.GATEWAY_LOOKUP_CACHE_S = 60
    from django.core.cache import cache

    cache.clear()
    authorization = f"Bearer {alpha_key}"
    with pytest.raises(_NotRemembered):  # nothing remembered yet: the database path must run
        _prepare_remembered(authorization, body("tiny"), None)
    _prepare_chat(authorization, body("tiny"))  # counted: 1
    with django_assert_num_queries(0):
        route = _prepare_remembered(authorization, body("tiny"), None)  # counted: 2
    assert route.target.model_id == "tiny" and [s.url for s in route.servers] == ["http://a:1"]
    with pytest.raises(GatewayError) as error:
        _prepare_remembered(authorization, body("tiny"), None)
    assert error.value.status == 429
    with pytest.raises(_NotRemembered):  # another model: not remembered, and not counted here
        _prepare_remembered(authorization, body("math/agent:latest"), None)
