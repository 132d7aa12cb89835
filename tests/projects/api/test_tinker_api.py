"""The Tinker API's answers that need no worker: keys, tenancy, bad input, futures.

(The SDK driving a live stack end to end: tests/integration/test_tinker_sdk.py.)"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import services
from projects.models import Run, RunKind, TinkerFuture, TinkerModel

pytestmark = pytest.mark.django_db

BASE = "tinker-tiny"


@pytest.fixture
def tinker(cast, tiny_model_dir, settings):
    settings.TINKER_POLL_S = 1
    services.base_model_register(name=BASE, source=str(tiny_model_dir))
    keys = {
        "alpha": services.api_key_create(team=cast.alpha, name="t").plaintext,
        "beta": services.api_key_create(team=cast.beta, name="t").plaintext,
        "reader": services.api_key_create(team=cast.alpha, name="r", read_only=True).plaintext,
    }
    return keys


def call(
    route: str, body=None, *, key: str | None, method: str = "POST", raw: bytes | None = None, **headers
):
    client = Client()
    extra = {"HTTP_X_API_KEY": key} if key else {}
    extra.update(headers)
    url = f"/tinker/api/v1/{route}"
    if method == "GET":
        response = client.get(url, **extra)
    else:
        data = raw if raw is not None else json.dumps(body or {})
        content_type = extra.pop("content_type", "application/json")
        response = client.post(url, data=data, content_type=content_type, **extra)
    return response.status_code, response


def _model(key: str) -> str:
    status, reply = call("create_session", {"tags": [], "sdk_version": "0.38.0"}, key=f"tml-{key}")
    assert status == 200, reply.content
    session = reply.json()["session_id"]
    status, reply = call("create_model", {"session_id": session, "model_seq_id": 0, "base_model": BASE,
                                          "lora_config": {"rank": 4}}, key=f"tml-{key}")  # fmt: skip
    assert status == 200, reply.content
    return reply.json()["model_id"]


def test_keys_are_tml_prefixed_team_keys(tinker):
    assert call("client/config", key=None)[0] == 401
    assert call("client/config", key="tml-aw_nope_nope")[0] == 401
    status, reply = call("client/config", key=f"tml-{tinker['alpha']}")
    assert status == 200 and reply.json()["use_pyqwest_transport"] is False
    status, reply = call("get_server_capabilities", key=f"tml-{tinker['alpha']}", method="GET")
    assert BASE in [m["model_name"] for m in reply.json()["supported_models"]]


def test_a_training_client_is_a_tinker_run_of_the_team(tinker, cast):
    model_id = _model(tinker["alpha"])
    assert model_id.endswith(":train:0")
    run = Run.objects.get(kind=RunKind.TINKER)
    assert run.project.team == cast.alpha and run.model.lora["rank"] == 4
    status, reply = call("get_info", {"model_id": model_id}, key=f"tml-{tinker['alpha']}")
    assert status == 200 and reply.json()["model_data"]["model_name"] == BASE
    # Another team's key: the model, its checkpoints and futures do not exist.
    status, reply = call("get_info", {"model_id": model_id}, key=f"tml-{tinker['beta']}")
    assert status == 404 and reply.json()["error"]["param"] == "model_id"
    assert call(f"training_runs/{model_id}/checkpoints", key=f"tml-{tinker['beta']}", method="GET")[0] == 404
    status, reply = call("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}},
                         key=f"tml-{tinker['alpha']}")  # fmt: skip
    request_id = reply.json()["request_id"]
    assert call("retrieve_future", {"request_id": request_id}, key=f"tml-{tinker['beta']}")[0] == 404
    # A read-only key may read but not train.
    status, reply = call("optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}},
                         key=f"tml-{tinker['reader']}")  # fmt: skip
    assert status == 403 and "read-only" in reply.json()["error"]["message"]
    assert call("get_info", {"model_id": model_id}, key=f"tml-{tinker['reader']}")[0] == 200


def test_bad_input_is_a_400_naming_the_field(tinker):
    key = f"tml-{tinker['alpha']}"
    status, reply = call("create_session", raw=b"{not json", key=key)
    assert status == 400 and "not JSON" in reply.json()["error"]["message"]
    status, session = call("create_session", {"tags": []}, key=key)
    session_id = session.json()["session_id"]
    status, reply = call(
        "create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": "nope"}, key=key
    )
    assert (
        status == 400
        and reply.json()["error"]["param"] == "base_model"
        and BASE in reply.json()["error"]["message"]
    )
    status, reply = call("create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": BASE,
                                          "lora_config": {"rank": 0}}, key=key)  # fmt: skip
    assert status == 400 and reply.json()["error"]["param"] == "lora_config.rank"
    model_id = _model(tinker["alpha"])
    status, reply = call(
        "optim_step", {"model_id": model_id, "seq_id": 0, "adam_params": {"learning_rate": 1e-3}}, key=key
    )
    assert status == 400 and reply.json()["error"]["param"] == "seq_id"
    status, reply = call(
        "optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 5}}, key=key
    )
    assert status == 400 and reply.json()["error"]["param"] == "adam_params.learning_rate"
    status, reply = call("forward_backward", {"model_id": model_id}, key=key)
    assert status == 400 and "x-protobuf" in reply.json()["error"]["message"]
    status, reply = call(
        "load_weights", {"model_id": model_id, "seq_id": 1, "path": "s3://x", "optimizer": True}, key=key
    )
    assert status == 400 and reply.json()["error"]["param"] == "path"
    status, reply = call("load_weights", {"model_id": model_id, "seq_id": 1, "path": f"tinker://{model_id}/weights/none",
                                          "optimizer": True}, key=key)  # fmt: skip
    assert status == 404
    status, reply = call("asample", {"sampling_session_id": "nope", "prompt": {"chunks": []}, "num_samples": 1,
                                     "sampling_params": {}}, key=key)  # fmt: skip
    assert status == 404 and reply.json()["error"]["param"] == "sampling_session_id"


def test_futures_are_long_polled_deduplicated_and_fail_readably(tinker):
    key = f"tml-{tinker['alpha']}"
    model_id = _model(tinker["alpha"])
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    first = call("optim_step", body, key=key)[1].json()["request_id"]
    again = call("optim_step", body, key=key)[1].json()["request_id"]
    assert first == again  # a retried submission is the same request, run once
    # Nothing runs it here (no worker): the poll is held, then the SDK is told to ask again.
    status, reply = call("retrieve_future", {"request_id": first}, key=key)
    assert status == 200 and reply.json() == {
        "type": "try_again",
        "request_id": first,
        "queue_state": "active",
    }
    future = TinkerFuture.objects.get(pk=first)
    services.tinker_future_finish(future=future, error="the loss is not finite", category="user")
    status, reply = call("retrieve_future", {"request_id": first}, key=key)
    assert status == 200 and reply.json() == {"error": "the loss is not finite", "category": "user"}
    assert TinkerModel.objects.get(pk=model_id).done_seq == 1  # the next request may run
