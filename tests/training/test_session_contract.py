"""One contract, every host: the same calls (training.session.contract.Session's primitives, as a
Tinker client makes them: two forward_backward per optim_step, twice, then forward; and a greedy
sample) on a session in this process, on the trainer service (another process, over HTTP) and on
two gloo ranks (a pool session with a follower process) give the same losses, gradient norms,
logprobs and sampled tokens as one plain session does alone.

The per-host suites (test_session_pool, test_trainer_service, test_session_ranks) test what is
particular to each host; this one holds them to one set of numbers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tests.conftest import trainer_service
from tests.training.test_session_ranks import LORA, calls, close, config, load, pool_of
from training.engines.base import SamplingParams
from training.hosting.followers import follower_pids
from training.session.contract import Session
from training.session.local import TrainingSession
from training.session.policy import Policy

HOSTS = ("in_process", "trainer_service", "two_gloo_ranks")
PROMPTS = [[5, 9, 14], [7, 3]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@contextlib.contextmanager
def session_on(host: str, tiny_model_dir, tmp_path) -> Iterator[Session]:
    """A fresh session (seed, LoRA and config as ``alone``'s) on ``host``, closed afterwards."""
    if host == "trainer_service":
        with trainer_service(tmp_path / "root", tiny_model_dir.parent) as client:
            remote = client.open(
                "contract", holder="t", base_model=str(tiny_model_dir), config=config(1), lora=LORA
            )
            yield remote
            remote.close()
        return
    pool = pool_of(tiny_model_dir, tmp_path)
    pool.open("contract", str(tiny_model_dir), config(2 if host == "two_gloo_ranks" else 1), LORA)
    try:
        with pool.use("contract") as session:
            yield session
    finally:
        pool.close("contract")


def run_contract(session: Session) -> tuple[list[float], list[list[int]]]:
    """The calls, then a greedy sample of the trained adapter."""
    seen = calls(session)
    return seen, [choice.token_ids for choice in session.sample(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tuple[list[float], list[list[int]]]:
    """One plain session in this process, on one torch thread as the service and the follower run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load(str(tiny_model_dir))
        return run_contract(TrainingSession(Policy(model, tokenizer, config(1), LORA)))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("host", HOSTS)
def test_every_host_gives_the_same_numbers_for_the_same_calls(
    host, reference, tiny_model_dir, tmp_path, one_thread
):
    expected, expected_samples = reference
    with session_on(host, tiny_model_dir, tmp_path) as session:
        got, sampled = run_contract(session)
    assert sampled == expected_samples
    assert close(got, expected), [(a, b) for a, b in zip(got, expected, strict=True) if abs(a - b) > 1e-5][:5]
    assert follower_pids() == []  # the ranks' follower stopped with its session
