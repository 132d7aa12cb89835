"""Data-parallel sessions in a SessionPool (a Tinker training client with ``devices``: 2 gloo ranks on
CPU): the pool's session is rank 0 and a follower process holds rank 1. Its primitives, called one by
one as a client calls them, train as one process does on the same calls; a follower lost between
calls is restarted and the calls since the last optim_step replayed; bad input in one rank's share
fails the call on every rank and leaves the ranks in step; a pool trains one such session at a time."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.training.test_distributed import DATA
from training.config import LoraSpec, TrainConfig
from training.hosting.followers import follower_pids
from training.hosting.pool import SessionPool
from training.hosting.ranks import shares
from training.session.contract import Datum
from training.session.local import TrainingSession
from training.session.losses import LossInputError

LORA = LoraSpec(rank=2, alpha=4)
RATE = 1e-2
# Gradients summed over the ranks differ from one process's in the order of float32 additions:
# losses, grad norms and logprobs agree to TOLERANCE. AdamW scales each weight's step by its own
# gradient's size, so a near-zero gradient's addition-order noise can move its weight by a fraction
# of the learning rate: weights agree to WEIGHT_TOLERANCE (a CI run measured 3.8e-5 after two steps
# at RATE, where this machine alone measures under 1e-5).
TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 1e-4


def config(devices: int) -> TrainConfig:
    return TrainConfig(seed=3, micro_batch_tokens=16, devices=devices)


def load(source: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), AutoTokenizer.from_pretrained(
        source
    )


def pool_of(tiny_model_dir, tmp_path) -> SessionPool:
    return SessionPool(load, spill_dir=tmp_path / "spill", model_cache_dir=tiny_model_dir.parent)


def calls(session, after_first=lambda: None) -> list[float]:
    """What a Tinker client does: two forward_backward calls per optim_step, twice, then a forward;
    ``after_first`` runs after the first call (between calls, as a client's requests are)."""
    seen = []
    for round_ in range(2):
        seen.append(session.forward_backward(DATA[:3], "ppo").loss)
        if round_ == 0:
            after_first()
        seen.append(session.forward_backward(DATA[3:], "cross_entropy").loss)
        seen.append(session.optim_step(learning_rate=RATE)["grad_norm"])
    seen.extend(value for row in session.forward(DATA) for value in row)
    return seen


def alone(tiny_model_dir) -> tuple[list[float], list[torch.Tensor]]:
    from training.session.policy import Policy

    model, tokenizer = load(str(tiny_model_dir))
    session = TrainingSession(Policy(model, tokenizer, config(1), LORA))
    return calls(session), [p.detach().clone() for p in session.trainer.trainable_parameters]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= TOLERANCE * max(1.0, abs(y)) for x, y in zip(a, b, strict=True)
    )


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        time.sleep(0.05)


def test_a_pool_session_on_two_devices_trains_as_one_process_beside_another_session(tiny_model_dir, tmp_path):
    expected, expected_params = alone(tiny_model_dir)
    pool = pool_of(tiny_model_dir, tmp_path)
    pool.open("dp", str(tiny_model_dir), config(2), LORA)
    pool.open("solo", str(tiny_model_dir), TrainConfig(seed=9, micro_batch_tokens=16), LORA)
    assert len(follower_pids()) == 1
    assert pool.stats()["data_parallel"] == {"dp": {"devices": 2, "rank_restarts": 0}}

    def other_team() -> None:  # another session on the same base, between the client's calls
        with pool.use("solo") as solo:
            solo.forward_backward(DATA, "ppo")
            solo.optim_step(learning_rate=RATE)

    got: list[float] = []
    for index in range(7):  # each primitive in its own use, as a trainer service runs requests
        with pool.use("dp") as session:
            assert session.world_size == 2
            if index in (0, 3):
                got.append(session.forward_backward(DATA[:3], "ppo").loss)
            elif index in (1, 4):
                got.append(session.forward_backward(DATA[3:], "cross_entropy").loss)
            elif index in (2, 5):
                got.append(session.optim_step(learning_rate=RATE)["grad_norm"])
            else:
                got.extend(value for row in session.forward(DATA) for value in row)
            params = [p.detach().clone() for p in session.trainer.trainable_parameters]
        other_team()
    assert close(got, expected), (got[:6], expected[:6])
    assert gap(params, expected_params) < WEIGHT_TOLERANCE
    with pytest.raises(ValueError, match="data-parallel: its ranks hold it"):
        pool.evict("dp")
    pool.close("dp")
    assert follower_pids() == []
    pool.close("solo")


def test_a_follower_lost_between_calls_is_restarted_and_the_calls_since_the_step_are_replayed(
    tiny_model_dir, tmp_path
):
    """SIGKILL of rank 1 after a forward_backward (its gradient share lost) and again while idle
    after an optim_step: the session restarts it from rank 0's state and replays; nothing differs."""
    expected, expected_params = alone(tiny_model_dir)
    pool = pool_of(tiny_model_dir, tmp_path)
    pool.open("dp", str(tiny_model_dir), config(2), LORA)
    with pool.use("dp") as session:
        first = follower_pids()
        got = calls(session, after_first=lambda: kill(first[0]))
        params = [p.detach().clone() for p in session.trainer.trainable_parameters]
        assert session.recoveries == 1
        second = follower_pids()
        assert second != first
        kill(second[0])
        session.forward(DATA[:1])  # idle loss found at the next call
        assert session.recoveries == 2
    assert close(got, expected), (got[:6], expected[:6])
    assert gap(params, expected_params) < WEIGHT_TOLERANCE
    assert pool.stats()["data_parallel"]["dp"]["rank_restarts"] == 2
    pool.close("dp")
    assert follower_pids() == []


def test_bad_input_in_one_ranks_share_fails_the_call_on_every_rank_and_the_ranks_stay(
    tiny_model_dir, tmp_path
):
    bad = Datum(
        model_input=[5, 6, 7], loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]}
    )
    data = [DATA[0], bad]  # no logprobs / advantages: 'ppo' refuses it
    assert shares(data, 2) == [[0], [1]]  # the bad datum is rank 1's: rank 0's own share is fine
    expected, _ = alone(tiny_model_dir)
    pool = pool_of(tiny_model_dir, tmp_path)
    pool.open("dp", str(tiny_model_dir), config(2), LORA)
    with pool.use("dp") as session:
        pids = follower_pids()
        with pytest.raises(LossInputError, match="ppo"):
            session.forward_backward(data, "ppo")
        # Rank 0 computed its share before rank 1 failed: the failed call left no gradient behind.
        assert all(p.grad is None for p in session.trainer.trainable_parameters)
        got = calls(session)
        assert follower_pids() == pids and session.recoveries == 0
    assert close(got, expected)
    pool.close("dp")


def test_a_pool_trains_one_data_parallel_session_at_a_time(tiny_model_dir, tmp_path):
    pool = pool_of(tiny_model_dir, tmp_path)
    pool.open("first", str(tiny_model_dir), config(2), LORA)
    with pytest.raises(ValueError, match=r"already trains a data-parallel session \(first\)"):
        pool.open("second", str(tiny_model_dir), config(2), LORA)
    assert "second" not in pool and len(follower_pids()) == 1
    with pytest.raises(ValueError, match="cannot change to 1"):
        pool.configure("first", config(1))
    pool.configure("first", TrainConfig(seed=3, micro_batch_tokens=16, devices=2, learning_rate=5e-4))
    pool.close("first")
    pool.open("second", str(tiny_model_dir), config(2), LORA)
    assert len(follower_pids()) == 1
    pool.close("second")
    without = SessionPool(load, spill_dir=tmp_path / "other")  # no model cache: no ranks to start
    with pytest.raises(ValueError, match="cannot start data-parallel ranks"):
        without.open("dp", str(tiny_model_dir), config(2), LORA)


def art_groups(source: str) -> list:
    """Two trajectory groups an ART client would send (training.runs.art_groups' wire form)."""
    from transformers import AutoTokenizer

    from tests.training.test_client_groups import Sampler, group, trajectory

    sampler = Sampler(AutoTokenizer.from_pretrained(source))
    groups = []
    for question, answers in (("Hi", ("hello", "bye now")), ("Name a colour", ("red", "a blue sky at noon"))):
        prompt = [{"role": "user", "content": question}]
        groups.append(group(*(trajectory([*prompt, sampler.choice(prompt, text)], float(i))
                              for i, text in enumerate(answers))))  # fmt: skip
    return groups


class QuietHooks:
    """A client step's hooks that take nothing down."""

    def started(self, *, num_sequences: int) -> None:
        pass


def test_an_art_job_on_two_devices_trains_as_on_one_and_frees_a_kept_data_parallel_session(
    tiny_model_dir, tmp_path
):
    """A model's ART training job with ``devices: 2`` (its session in the worker's pool, a follower
    for rank 1, ART's loss with a KL penalty against the base) records the step one device does;
    a kept data-parallel session of another model gives way to the next one, and a model whose
    devices changed gets a session opened afresh."""
    from pathlib import Path

    from safetensors.torch import load_file

    from training.hosting.resident import ResidentSessions, SessionKey
    from training.recipes.art_config import art_job_config
    from training.runs.art_groups import parse_groups
    from training.runs.art_step import ClientStepSpec, train_client_step

    source = str(tiny_model_dir)
    groups = art_groups(source)

    def job(sessions: ResidentSessions, model: str, devices: int, root: str):
        config, options = art_job_config({"learning_rate": 1e-2, "kl_penalty_coef": 0.5})
        config = TrainConfig(**{**config.to_dict(), "devices": devices, "micro_batch_tokens": 16})
        spec = ClientStepSpec(base_model_source=source, model_cache_dir=tiny_model_dir.parent,
                              checkpoint_root=tmp_path / root, config=config, options=options, lora=LORA,
                              groups=parse_groups(groups), from_step=0, resume_from=None)  # fmt: skip
        key = SessionKey(model=model, step=0, digest="d", base_model_source=source, devices=devices)
        sessions.attach(spec, key)
        try:
            result = train_client_step(spec, QuietHooks())
        except BaseException:
            sessions.settle(model, None)
            raise
        sessions.settle(model, SessionKey(model=model, step=1, digest="e", base_model_source=source,
                                          devices=devices))  # fmt: skip
        return result

    def weights(result) -> dict[str, torch.Tensor]:
        return load_file(Path(result.path) / "adapter_model.safetensors")

    one = job(ResidentSessions(load, capacity=2, spill_dir=tmp_path / "one"), "m-a", 1, "one")
    sessions = ResidentSessions(
        load, capacity=2, spill_dir=tmp_path / "two", model_cache_dir=tiny_model_dir.parent
    )
    two = job(sessions, "m-a", 2, "two")
    assert one.metrics["kl"] != 0.0
    for name in ("loss", "grad_norm", "kl", "trainable_tokens"):
        assert two.metrics[name] == pytest.approx(one.metrics[name], rel=1e-4, abs=1e-6), name
    expected = weights(one)
    assert max(float((weights(two)[k] - v).abs().max()) for k, v in expected.items()) < WEIGHT_TOLERANCE
    assert sessions.pool.stats()["data_parallel"] == {"m-a": {"devices": 2, "rank_restarts": 0}}

    job(sessions, "m-b", 2, "b")  # another model's data-parallel job: the kept one gives way
    assert "m-a" not in sessions.pool and list(sessions.pool.stats()["data_parallel"]) == ["m-b"]
    assert len(follower_pids()) == 1
    sessions.attach(
        ClientStepSpec(base_model_source=source, model_cache_dir=tmp_path, checkpoint_root=tmp_path / "c",
                       config=TrainConfig(seed=3), lora=LORA, groups=[], from_step=1, resume_from=None),
        SessionKey(model="m-b", step=1, digest="e", base_model_source=source, devices=1),
    )  # fmt: skip
    assert sessions.misses == 3 and sessions.pool.stats()["data_parallel"] == {} and follower_pids() == []
    sessions.settle("m-b", None)
