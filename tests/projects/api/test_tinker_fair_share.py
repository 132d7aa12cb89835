"""A fair share of the shared trainer through the Tinker API (issue 51): a sample's size is capped
before it is queued (max_tokens, the prompt within the model's context, ids in its vocabulary), a
team's queue is bounded with a 429 and Retry-After while other teams go on, and a training
request with a token id outside the vocabulary is refused naming the datum and the position."""

from __future__ import annotations

import pytest

from projects import services
from projects.jobs import tinker as tinker_jobs
from projects.models import TinkerFuture, TinkerFutureStatus, TinkerModel
from tests.projects.api.test_tinker_api import BASE, _model, call
from tests.projects.api.test_tinker_api import tinker as tinker  # noqa: F401 (the fixture)
from tests.projects.jobs.test_tinker_recovery import forward_backward

pytestmark = pytest.mark.django_db


def _sampler(key: str) -> str:
    session = call("create_session", {"tags": []}, key=key)[1].json()["session_id"]
    reply = call("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                              "base_model": BASE}, key=key)[1]  # fmt: skip
    return reply.json()["sampling_session_id"]


def _sample(sampler: str, tokens: list[int], **params) -> dict:
    return {"sampling_session_id": sampler, "num_samples": 1, "sampling_params": params,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}}  # fmt: skip


def test_a_sample_over_the_caps_is_a_400_naming_the_field_before_it_is_queued(tinker, settings):
    key = f"tml-{tinker['alpha']}"
    sampler = _sampler(key)
    settings.INFERENCE_MAX_TOKENS = 256
    for body, param, words in (
        (_sample(sampler, [1, 2], max_tokens=10**9), "sampling_params.max_tokens", "from 1 to 256"),
        (_sample(sampler, [1, 2], max_tokens="many"), "sampling_params.max_tokens", "from 1 to 256"),
        (_sample(sampler, [5] * 1000, max_tokens=100), "sampling_params.max_tokens", "context of 1024"),
        (_sample(sampler, [5, 1_000_000], max_tokens=2), "prompt", "token id 1000000 at position 1"),
    ):
        status, reply = call("asample", body, key=key)
        error = reply.json()["error"]
        assert (status, error["param"]) == (400, param) and words in error["message"], reply.content
    assert not TinkerFuture.objects.filter(kind="sample").exists()  # nothing reached the queue
    status, reply = call("asample", _sample(sampler, [5] * 1000, max_tokens=24), key=key)
    assert status == 200, reply.content  # 1000 + 24 fits the 1024 tokens


def test_a_teams_queue_is_bounded_with_a_429_and_retry_after_while_others_go_on(tinker, settings):
    settings.TINKER_MAX_PENDING_SAMPLES_PER_TEAM = 2
    settings.TINKER_MAX_PENDING_TRAINING_PER_TEAM = 1
    settings.TINKER_RETRY_AFTER_S = 7
    alpha, beta = f"tml-{tinker['alpha']}", f"tml-{tinker['beta']}"
    sampler = _sampler(alpha)
    body = _sample(sampler, [1, 2], max_tokens=2)
    first = call("asample", body, key=alpha)[1].json()["request_id"]
    assert call("asample", body, key=alpha)[0] == 200
    status, reply = call("asample", body, key=alpha)
    error = reply.json()["error"]
    assert status == 429 and reply["Retry-After"] == "7"
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "TINKER_MAX_PENDING_SAMPLES_PER_TEAM" in error["message"]
    assert call("asample", _sample(_sampler(beta), [1, 2], max_tokens=2), key=beta)[0] == 200  # not beta's
    services.tinker_future_finish(future=TinkerFuture.objects.get(pk=first), blob=b"done")
    assert call("asample", body, key=alpha)[0] == 200  # one finished: room for one more
    # Training requests count apart; a retried submission is the same request, not one more.
    model_id = _model(tinker["alpha"])
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    assert call("optim_step", step, key=alpha)[0] == 200
    assert call("optim_step", step, key=alpha)[0] == 200
    status, reply = call("optim_step", {**step, "seq_id": 2}, key=alpha)
    assert status == 429 and reply["Retry-After"] == "7"
    assert "TINKER_MAX_PENDING_TRAINING_PER_TEAM" in reply.json()["error"]["message"]


def test_a_token_id_outside_the_vocabulary_is_a_400_at_the_api_and_a_failed_future_in_the_worker(
    tinker, settings
):
    settings.TRAINER_SERVICE_URL = ""  # the worker process's own sessions (training.hosting.resident)
    key = f"tml-{tinker['alpha']}"
    model_id = _model(tinker["alpha"])
    raw = forward_backward(model_id, 1, [5, 9, 1_000_000, 7])
    status, reply = call("forward_backward", key=key, raw=raw, content_type="application/x-protobuf")
    error = reply.json()["error"]
    assert (status, error["param"]) == (400, "data[0].model_input[2]"), reply.content
    assert "token id 1000000 is outside the model's vocabulary" in error["message"]
    assert not TinkerFuture.objects.filter(kind="forward_backward").exists()  # nothing was queued
    # A request the web could not check (its host does not hold the model) fails in the worker, the
    # session's own check naming the datum and the position, and the session stays intact.
    model = TinkerModel.objects.get(pk=model_id)
    future = services.tinker_future_submit(team=model.session.team, kind="forward_backward", model=model,
                                           seq_id=1, payload={"forward_only": False}, body=raw)  # fmt: skip
    tinker_jobs.drain(model_id)
    future.refresh_from_db()
    assert future.status == TinkerFutureStatus.FAILED and future.category == "user"
    assert "data[0].model_input[2]: token id 1000000 is outside the model's vocabulary" in future.error
    raw = forward_backward(model_id, 2, [5, 9, 2, 7])
    status, reply = call("forward_backward", key=key, raw=raw, content_type="application/x-protobuf")
    assert status == 200, reply.content
    tinker_jobs.drain(model_id)
    assert TinkerFuture.objects.get(pk=reply.json()["request_id"]).status == TinkerFutureStatus.DONE
