"""A Tinker training client whose session's keeper restarted is rebuilt exactly from what is on
record (projects.jobs.tinker_recovery), or, when that cannot be proven, lost as before."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from projects.jobs import hosts
from projects.jobs import tinker as tinker_jobs
from projects.models import Checkpoint, RunEvent, TinkerFuture, TinkerFutureStatus, TinkerModel
from projects.storage import checkpoint_local_dir
from tests.projects.api.test_tinker_api import _model, call
from tests.projects.api.test_tinker_api import tinker as tinker  # noqa: F401 (the fixture)

pytestmark = pytest.mark.django_db


def forward_backward(model_id: str, seq: int, tokens: list[int]) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


class Client:
    """One training client's requests, numbered as the SDK numbers them, each run at once."""

    def __init__(self, key: str) -> None:
        self.key, self.model_id, self.seq = f"tml-{key}", _model(key), 0

    def send(self, route: str, body: dict | None = None, *, raw: bytes | None = None) -> TinkerFuture:
        self.seq += 1
        if raw is not None:
            status, reply = call(route, key=self.key, raw=raw, content_type="application/x-protobuf")
        else:
            status, reply = call(
                route, {"model_id": self.model_id, "seq_id": self.seq, **(body or {})}, key=self.key
            )
        assert status == 200, reply.content
        tinker_jobs.drain(self.model_id)
        return TinkerFuture.objects.get(pk=reply.json()["request_id"])

    def forward_backward(self, tokens: list[int]) -> TinkerFuture:
        return self.send("forward_backward", raw=forward_backward(self.model_id, self.seq + 1, tokens))

    def optim_step(self) -> TinkerFuture:
        return self.send("optim_step", {"adam_params": {"learning_rate": 5e-2}})

    def save(self, name: str) -> TinkerFuture:
        return self.send("save_weights", {"path": name})

    def adapter(self, step: int) -> dict[str, torch.Tensor]:
        checkpoint = Checkpoint.objects.get(model=TinkerModel.objects.get(pk=self.model_id).model, step=step)
        return load_file(checkpoint_local_dir(checkpoint) / "adapter_model.safetensors")


TOKENS = [[5, 9, 2, 7, 11], [3, 8, 8, 1], [12, 4, 6, 10, 2, 9]]


def train(client: Client, *, restart_after: int | None) -> list[TinkerFuture]:
    """fb, optim, fb, save, fb, optim, fb, optim, save; the keeper restarts after request ``restart_after``."""
    plan = [
        lambda: client.forward_backward(TOKENS[0]),
        client.optim_step,
        lambda: client.forward_backward(TOKENS[1]),
        lambda: client.save("middle"),  # with a gradient pending, which the saved state does not hold
        lambda: client.forward_backward(TOKENS[2]),
        client.optim_step,
        lambda: client.forward_backward(TOKENS[0]),
        client.optim_step,
        lambda: client.save("final"),
    ]
    futures = []
    for index, request in enumerate(plan, start=1):
        futures.append(request())
        if index == restart_after:
            hosts._resident = None  # a new worker process: every session it held is gone
    return futures


def rebuilt_events(client: Client) -> list[str]:
    run = TinkerModel.objects.get(pk=client.model_id).run
    return [e.message for e in RunEvent.objects.filter(run=run) if "session was rebuilt" in e.message]


@pytest.mark.parametrize("restart_after", [2, 4, 5, 7])
def test_a_session_lost_with_its_keeper_is_rebuilt_to_the_same_weights(tinker, restart_after):  # noqa: F811
    whole, broken = Client(tinker["alpha"]), Client(tinker["alpha"])
    expected = train(whole, restart_after=None)
    got = train(broken, restart_after=restart_after)
    assert [f.status for f in got] == [TinkerFutureStatus.DONE] * len(got), [f.error for f in got]
    assert [f.result for f in got if f.kind == "optim_step"] == [
        f.result for f in expected if f.kind == "optim_step"
    ]
    final, again = whole.adapter(3), broken.adapter(3)
    assert final.keys() == again.keys()
    assert all(torch.equal(final[name], again[name]) for name in final)
    assert any(not torch.equal(final[name], whole.adapter(1)[name]) for name in final)  # training moved it
    [event] = rebuilt_events(broken)
    # After request 2 nothing was saved: from the fresh adapter. Later: from the save at step 1
    # (request 4), with the gradient pending then (request 3) and the requests since.
    saved = "its checkpoint of step 1"
    origin, replayed = {2: ("a fresh adapter", 2), 4: (saved, 1), 5: (saved, 2), 7: (saved, 4)}[restart_after]
    assert f"from {origin} by running {replayed} request" in event, event
    assert not TinkerModel.objects.get(pk=broken.model_id).lost


def test_a_session_whose_requests_do_not_give_the_same_answers_again_is_lost(tinker):  # noqa: F811
    client = Client(tinker["alpha"])
    client.forward_backward(TOKENS[0])
    step = client.optim_step()
    TinkerFuture.objects.filter(pk=step.pk).update(
        result={"type": "optim_step", "metrics": {"grad_norm:mean": 1.0}}
    )
    hosts._resident = None
    failed = client.forward_backward(TOKENS[1])
    assert failed.status == TinkerFutureStatus.FAILED
    assert "could not be rebuilt: running request 2 (optim_step) again gave other metrics" in failed.error
    assert "load_state" in failed.error
    assert TinkerModel.objects.get(pk=client.model_id).lost
    # Every later request is refused saying so (the client goes on from a state it saved).
    status, reply = call(
        "optim_step",
        {"model_id": client.model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}},
        key=client.key,
    )
    assert status == 400 and reply.json()["error"]["param"] == "model_id"
    assert "could not be rebuilt" in reply.json()["error"]["message"]
    assert rebuilt_events(client) == []


def test_too_many_requests_to_run_again_leave_the_session_lost(tinker, settings):  # noqa: F811
    settings.TINKER_REPLAY_MAX = 1
    client = Client(tinker["alpha"])
    client.forward_backward(TOKENS[0])
    client.optim_step()
    hosts._resident = None
    failed = client.forward_backward(TOKENS[1])
    assert failed.status == TinkerFutureStatus.FAILED
    assert "2 requests since a fresh adapter would have to run again (more than 1)" in failed.error


def test_a_save_may_carry_a_ttl_as_the_sdk_sends_it(tinker):  # noqa: F811
    client = Client(tinker["alpha"])
    client.forward_backward(TOKENS[0])
    client.optim_step()
    assert (
        client.send("save_weights", {"path": "kept", "ttl_seconds": 7200}).status == TinkerFutureStatus.DONE
    )
    assert client.send("save_weights_for_sampler", {"path": "sampled"}).status == TinkerFutureStatus.DONE
    rows = call(f"training_runs/{client.model_id}/checkpoints", key=client.key, method="GET")[1].json()
    expiry = {row["checkpoint_id"]: row["expires_at"] for row in rows["checkpoints"]}
    assert expiry["sampler_weights/sampled"] is None and expiry["weights/kept"] is not None
    status, reply = call("save_weights", {"model_id": client.model_id, "seq_id": 9, "path": "x", "ttl_seconds": 5},
                         key=client.key)  # fmt: skip
    assert status == 400 and reply.json()["error"]["param"] == "ttl_seconds"
