"""The trainer service (training.hosting.service) and its client (training.hosting.client): leases
refuse anyone but the holder until they lapse, a request names no file outside the service's folder,
bad input is a 400 naming the field; and over HTTP against a real service process, two teams'
sessions interleaving on one base train exactly as each does alone."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.training.test_session_pool import ALPHA, BETA, DATA, alone, load
from training.hosting.client import LeaseLost, TrainerServiceClient, TrainerServiceError
from training.hosting.pool import SessionPool
from training.hosting.service import ServiceConfig, ServiceError, TrainerService


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def service(tiny_model_dir, tmp_path):
    pool = SessionPool(load, spill_dir=tmp_path / "spill")
    return TrainerService(pool, ServiceConfig(root=tmp_path), clock=Clock())


def datum_json(datum) -> dict:
    return {"model_input": datum.model_input, "loss_fn_inputs": datum.loss_fn_inputs}


def refused(service, method, path, body) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        service.handle(method, path, body)
    return caught.value


def test_a_lapsed_lease_nobody_claimed_since_is_still_its_holders(service, tiny_model_dir):
    """A holder's call that arrives after its lease lapsed (queued behind other work on a busy
    service) runs and renews the lease while no other holder has claimed the session since; once
    another has, it is refused."""
    config, lora = ALPHA
    opened = {"session_id": "team-a", "holder": "job-1", "base_model": str(tiny_model_dir),
              "config": config.to_dict(), "lora": lora.to_dict(), "lease_s": 30}  # fmt: skip
    assert service.handle("POST", "/sessions", opened)[0] == 200
    forward = {"data": [datum_json(DATA["alpha"][0][0])]}
    service.clock.now += 31  # lapsed: nobody else asked for it
    assert service.stats()["held"] == {}
    status, body = service.handle("POST", "/sessions/team-a/forward_backward",
                                  {"holder": "job-1", "loss_fn": "cross_entropy", **forward})  # fmt: skip
    assert status == 200 and body["loss"] > 0
    assert service.stats()["held"] == {"team-a": "job-1"}  # renewed by that call
    assert refused(service, "POST", "/sessions/team-a/claim", {"holder": "job-2"}).status == 409
    service.clock.now += 61  # lapsed again, and this time another holder claims it first
    assert service.handle("POST", "/sessions/team-a/claim", {"holder": "job-2"})[0] == 200
    lost = refused(service, "POST", "/sessions/team-a/optim_step", {"holder": "job-1", "learning_rate": 1e-3})
    assert lost.status == 409 and lost.code == "lease_lost"


def test_stats_and_heartbeats_answer_while_many_requests_wait_for_the_lock(service, tiny_model_dir):
    """Requests waiting for the service's lock (primitives behind another team's long sample) each
    hold a thread; more of them than asyncio's default pool has threads (os.cpu_count() + 4, at
    most 32) must not hold up /stats, a heartbeat or a claim, or leases lapse on a busy service."""
    config, lora = ALPHA
    opened = {"session_id": "team-a", "holder": "job-1", "base_model": str(tiny_model_dir),
              "config": config.to_dict(), "lora": lora.to_dict(), "lease_s": 600}  # fmt: skip
    assert service.handle("POST", "/sessions", opened)[0] == 200
    forward = json.dumps({"holder": "job-1", "data": [datum_json(DATA["alpha"][0][0])]}).encode()

    async def call(method: str, path: str, payload: bytes) -> int:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": payload, "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await service({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
        return sent[0]["status"]

    async def scenario() -> tuple[list[int], list[int]]:
        waiting = [asyncio.create_task(call("POST", "/sessions/team-a/forward", forward)) for _ in range(40)]
        await asyncio.sleep(0.5)  # each in a thread by now, waiting for the lock
        try:
            answered = [
                await asyncio.wait_for(call("GET", "/stats", b""), timeout=5),
                await asyncio.wait_for(call("POST", "/sessions/team-a/heartbeat", b'{"holder": "job-1"}'), 5),
            ]
        finally:
            service._lock.__exit__(None, None, None)  # the long sample ends
        return answered, list(await asyncio.gather(*waiting))

    service._lock.__enter__()  # another team's sample holds the lock
    answered, forwards = asyncio.run(scenario())
    assert answered == [200, 200]
    assert forwards == [200] * 40


def test_a_lease_keeps_everyone_else_out_until_it_lapses(service, tiny_model_dir):
    config, lora = ALPHA
    opened = {"session_id": "team-a", "holder": "job-1", "base_model": str(tiny_model_dir),
              "config": config.to_dict(), "lora": lora.to_dict(), "lease_s": 30, "tag": "step-0"}  # fmt: skip
    assert service.handle("POST", "/sessions", opened)[0] == 200
    forward = {"data": [datum_json(DATA["alpha"][0][0])]}
    assert (
        len(service.handle("POST", "/sessions/team-a/forward", {"holder": "job-1", **forward})[1]["logprobs"])
        == 1
    )
    other = refused(service, "POST", "/sessions/team-a/forward", {"holder": "job-2", **forward})
    assert other.status == 409 and other.code == "lease_lost"
    assert refused(service, "POST", "/sessions/team-a/claim", {"holder": "job-2"}).status == 409
    assert refused(service, "POST", "/sessions", {**opened, "holder": "job-2"}).status == 409
    # Heartbeats keep it; once they stop the lease lapses and the next holder may claim it.
    service.clock.now += 20
    service.handle("POST", "/sessions/team-a/heartbeat", {"holder": "job-1", "lease_s": 30})
    service.clock.now += 20
    assert refused(service, "POST", "/sessions/team-a/claim", {"holder": "job-2"}).status == 409
    service.clock.now += 11
    # A claim for another state than the session holds is refused: the caller loads that state instead.
    assert (
        refused(service, "POST", "/sessions/team-a/claim", {"holder": "job-2", "tag": "step-3"}).status == 412
    )
    assert (
        service.handle("POST", "/sessions/team-a/claim", {"holder": "job-2", "tag": "step-0"})[1]["holder"]
        == "job-2"
    )
    lost = refused(service, "POST", "/sessions/team-a/optim_step", {"holder": "job-1", "learning_rate": 1e-3})
    assert lost.status == 409 and "claim it again" in lost.message
    assert service.stats()["held"] == {"team-a": "job-2"} and service.stats()["base_loads"] == 1
    service.handle("POST", "/sessions/team-a/release", {"holder": "job-2"})
    assert service.stats()["held"] == {}
    assert service.handle("POST", "/sessions/team-a/claim", {"holder": "job-3"})[0] == 200
    # A holder that owns the work elsewhere (a run claimed in the database) takes a running lease.
    assert (
        refused(service, "POST", "/sessions/team-a/claim", {"holder": "job-4", "take": "yes"}).status == 409
    )
    assert (
        service.handle("POST", "/sessions/team-a/claim", {"holder": "job-4", "take": True})[1]["holder"]
        == "job-4"
    )
    assert refused(service, "POST", "/sessions/team-a/forward", {"holder": "job-3", **forward}).status == 409


def test_bad_requests_are_400s_naming_the_field_and_paths_stay_under_the_root(
    service, tiny_model_dir, tmp_path
):
    config, lora = ALPHA
    service.handle("POST", "/sessions", {"session_id": "s", "holder": "h", "base_model": str(tiny_model_dir),
                                         "config": config.to_dict(), "lora": lora.to_dict()})  # fmt: skip
    outside = refused(
        service, "POST", "/sessions/s/save_state", {"holder": "h", "path": "../../etc/x", "step": 1}
    )
    assert (outside.status, outside.param) == (
        400,
        "path",
    ) and "under the trainer's folder" in outside.message
    absolute = refused(
        service, "POST", "/sessions/s/save_weights_for_sampler", {"holder": "h", "path": "/tmp/x"}
    )
    assert absolute.status == 400
    assert refused(service, "POST", "/sessions/s/forward", {"holder": "h", "data": []}).param == "data"
    no_rate = refused(service, "POST", "/sessions/s/optim_step", {"holder": "h"})
    assert (no_rate.status, no_rate.param) == (400, "learning_rate")
    assert refused(service, "POST", "/sessions/nope/claim", {"holder": "h"}).status == 404
    assert refused(service, "POST", "/sessions", {"holder": "h", "session_id": "t", "base_model": "x",
                                                  "config": {"learning_rate": -1}}).status == 400  # fmt: skip
    assert (
        refused(service, "POST", "/sessions/s/heartbeat", {"holder": "h", "lease_s": 10**9}).param
        == "lease_s"
    )
    assert refused(service, "GET", "/sessions/s/nothing", {}).status == 404
    # Inside the root is fine, and the state is the checkpoint format a worker records.
    service.handle("POST", "/sessions/s/save_state", {"holder": "h", "path": "states/s-1", "step": 1})
    assert (tmp_path / "states" / "s-1" / "state.json").exists()


def test_two_teams_over_http_train_exactly_as_each_alone(live_service, tiny_model_dir, tmp_path, one_thread):
    source = str(tiny_model_dir)
    with pytest.raises(TrainerServiceError) as caught:
        TrainerServiceClient(live_service.url, token="wrong").stats()
    assert caught.value.status == 401
    sessions = {
        "alpha": live_service.open(
            "team-a", holder="a-job", base_model=source, config=ALPHA[0], lora=ALPHA[1]
        ),
        "beta": live_service.open("team-b", holder="b-job", base_model=source, config=BETA[0], lora=BETA[1]),
    }
    losses = {"alpha": [], "beta": []}
    for index in range(3):
        for name in ("alpha", "beta"):  # a's backward, b's backward, then both steps
            losses[name].append(sessions[name].forward_backward(DATA[name][index], "cross_entropy").loss)
        for name in ("alpha", "beta"):
            sessions[name].optim_step(learning_rate=1e-2)
    for name in ("alpha", "beta"):
        sessions[name].save_weights_for_sampler(f"out/{name}")
    sampled = sessions["alpha"].sample([[5, 9, 14]], {"max_new_tokens": 4, "temperature": 0})
    assert len(sampled) == 1 and len(sampled[0].token_ids) == len(sampled[0].logprobs) >= 1
    with pytest.raises(TrainerServiceError) as bad:
        sessions["alpha"].sample([[5, 9]], {"max_new_tokens": 0})
    assert bad.value.status == 400 and "max_new_tokens" in bad.value.message
    stats = live_service.stats()
    assert (stats["sessions"], stats["base_loads"]) == (2, 1)
    with pytest.raises(LeaseLost):  # team b's holder cannot drive team a's session
        type(sessions["alpha"])(live_service, "team-a", "b-job", 60).forward(DATA["alpha"][0])

    for name, (config, lora) in (("alpha", ALPHA), ("beta", BETA)):
        reference = alone(source, config, lora, DATA[name], save_to=tmp_path / "alone" / name)
        assert losses[name] == [loss for _, loss in reference[:3]]
        saved = load_file(tmp_path / "out" / name / "adapter_model.safetensors")
        expected = load_file(tmp_path / "alone" / name / "adapter_model.safetensors")
        assert saved.keys() == expected.keys() and len(saved) == len(reference[3])
        assert all(torch.equal(saved[key], expected[key]) for key in saved), f"{name}: not bit for bit"
    sessions["alpha"].close()
    assert live_service.stats()["sessions"] == 1


def test_token_ids_outside_the_vocabulary_and_oversized_samples_are_400s(service, tiny_model_dir):
    """The service protects itself from any caller: a bad id is a 400 naming the datum and position
    (not an IndexError's 500), max_new_tokens is capped, a prompt must fit the context."""
    import asyncio
    import json

    config, lora = ALPHA
    service.handle("POST", "/sessions", {"session_id": "s", "holder": "h", "base_model": str(tiny_model_dir),
                                         "config": config.to_dict(), "lora": lora.to_dict(), "lease_s": 3000})  # fmt: skip

    def answer(path: str, body: dict) -> tuple[int, dict]:
        sent: list[dict] = []
        raw = json.dumps(body).encode()

        async def receive() -> dict:
            return {"type": "http.request", "body": raw, "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        asyncio.run(service(scope, receive, send))
        return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))

    bad = {"model_input": [5, 9, 1_000_000], "loss_fn_inputs": {"target_tokens": [9, 1_000_000, 3]}}
    data = [datum_json(DATA["alpha"][0][0]), bad]
    status, body = answer(
        "/sessions/s/forward_backward", {"holder": "h", "data": data, "loss_fn": "cross_entropy"}
    )
    assert status == 400 and "data[1].model_input[2]: token id 1000000 is outside" in body["error"]["message"]
    status, body = answer("/sessions/s/sample", {"holder": "h", "prompts": [[5, 1_000_000]]})
    assert status == 400 and "prompts[0][1]: token id 1000000" in body["error"]["message"]
    status, body = answer(
        "/sessions/s/sample", {"holder": "h", "prompts": [[5]], "sampling": {"max_new_tokens": 10**9}}
    )
    assert (status, body["error"]["param"]) == (400, "sampling.max_new_tokens")
    status, body = answer(
        "/sessions/s/sample", {"holder": "h", "prompts": [[5] * 1000], "sampling": {"max_new_tokens": 100}}
    )
    assert status == 400 and "exceed the model's context of 1024" in body["error"]["message"]
    status, body = answer(
        "/sessions/s/sample", {"holder": "h", "prompts": [[5, 9]], "sampling": {"max_new_tokens": 2}}
    )
    assert status == 200 and len(body["choices"]) == 1


class RecordingPool(SessionPool):
    """A pool that records which session each use is for; a use of ``stall`` waits, holding the
    service's lock, until another thread is queued on that lock (so the order is not timing's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.uses: list[str] = []
        self.stall: tuple[str, object] | None = None  # (session id, the service's lock)

    def use(self, session_id):
        self.uses.append(session_id)
        if self.stall is not None and self.stall[0] == session_id:
            deadline = time.monotonic() + 30
            while self.stall[1].waiting() < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            self.stall = None  # once
        return super().use(session_id)


@pytest.mark.parametrize("slice_steps", [2, 0])
def test_a_forward_backward_submitted_during_a_long_sample_runs_before_the_sample_ends(
    tiny_model_dir, tmp_path, slice_steps
):
    """Sampling takes the (fair) lock a few decode steps at a time: another team's forward_backward
    queued meanwhile runs after one slice, not after the whole sample; the sample's tokens are those
    of an uninterrupted one. ``slice_steps`` 0 is the old behaviour (the lock held for the whole
    sample): there the forward_backward waits for the end, which is what the test tells apart."""
    from training.engines.base import SamplingParams
    from training.session.local import TrainingSession
    from training.session.policy import Policy

    pool = RecordingPool(load, spill_dir=tmp_path / "spill")
    service = TrainerService(pool, ServiceConfig(root=tmp_path, sample_slice_steps=slice_steps))
    for session_id, (config, lora) in (("sampler", ALPHA), ("trainer", BETA)):
        service.handle("POST", "/sessions", {"session_id": session_id, "holder": session_id, "lease_s": 3000,
                                             "base_model": str(tiny_model_dir), "config": config.to_dict(),
                                             "lora": lora.to_dict()})  # fmt: skip
    prompts = [[5, 9, 14], [8, 2], [3, 4, 5, 6]]
    wire = {"max_new_tokens": 40, "temperature": 1.0, "stop_token_ids": []}
    results: dict[str, object] = {}
    pool.uses.clear()
    pool.stall = ("sampler", service._lock)

    def sample() -> None:
        results["sample"] = service.handle("POST", "/sessions/sampler/sample",
                                           {"holder": "sampler", "prompts": prompts, "sampling": wire})[1]  # fmt: skip
        results["sample_done_at_use"] = len(pool.uses)

    sampling_thread = threading.Thread(target=sample)
    sampling_thread.start()
    while not pool.uses:  # the sample holds the lock
        time.sleep(0.005)
    fb = {"holder": "trainer", "data": [datum_json(DATA["beta"][0][0])], "loss_fn": "cross_entropy"}
    service.handle("POST", "/sessions/trainer/forward_backward", fb)
    trained_at_use = pool.uses.index("trainer")
    sampling_thread.join(timeout=120)
    sampler_uses = [i for i, who in enumerate(pool.uses) if who == "sampler"]
    if slice_steps:
        assert trained_at_use < sampler_uses[-1], pool.uses  # in between two slices of the sample
    else:
        assert sampler_uses == [0] and trained_at_use == 1, pool.uses  # after the whole sample
    # The tokens are those of one uninterrupted sample on a session of its own (the session's RNG).
    model, tokenizer = load(str(tiny_model_dir))
    alone = TrainingSession(Policy(model, tokenizer, *ALPHA))
    expected = alone.sample(prompts, SamplingParams(max_new_tokens=40, temperature=1.0))
    got = results["sample"]["choices"]
    assert [c["token_ids"] for c in got] == [c.token_ids for c in expected]
    if slice_steps:
        assert max(len(c.token_ids) for c in expected) > slice_steps  # the sample had several slices
