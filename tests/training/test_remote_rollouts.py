"""An overlapped run whose rollouts are sampled on an inference server (``rollouts_on:
inference_servers``, training.engines.remote_engine): a real server process of the tiny model
(``POST /generate``), the run in this process. The worker loads the base model once (the trainer's);
every checkpoint the rollouts use is the server's, checked against the trainer's policy when it was
saved; the run trains exactly as the same run with its sampler in the worker."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import training.loop as loop
from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_overlap import spec
from training.engines.remote_engine import RemoteEngine, RemoteEngineError, RolloutServer
from training.loop import run_training
from training.serving.protocol import ADAPTER_HEADER, ADAPTER_KEY_HEADER, ADAPTER_SHA256_HEADER

TOKEN = "t-rollouts"


@contextlib.contextmanager
def server_process(
    tiny_model_dir: Path, root: Path, device: str = "cpu"
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """An inference server process of the tiny model whose adapter root is ``root``."""
    env = {**os.environ, "INFERENCE_SERVER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    log = root.parent / f"{root.name}-server.log"  # a file, not a pipe nobody drains
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "training.serving.standalone", "--model", str(tiny_model_dir),
             "--cache-dir", str(tiny_model_dir.parent), "--adapter-root", str(root), "--threads", "1",
             "--device", device],
            stdout=output, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (
            lines := [x for x in log.read_text().splitlines() if x.startswith("inference server on ")]
        ):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield lines[0].split()[-1], process
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture
def server(tiny_model_dir, tmp_path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with server_process(tiny_model_dir, tmp_path) as running:
        yield running


def counted_loads(monkeypatch) -> list[str]:
    """Base models this process loads from now on (the trainer's, and a sampler's copy)."""
    loads: list[str] = []
    real = loop.load_policy_model

    def counting(source, cache, **kwargs):
        loads.append(source)
        return real(source, cache, **kwargs)

    monkeypatch.setattr(loop, "load_policy_model", counting)
    return loads


def test_an_overlapped_run_samples_its_rollouts_on_an_inference_server(
    tiny_model_dir, tmp_path, server, monkeypatch
):
    url, _ = server
    runs = {}
    for where in ("worker", "inference_servers"):
        root = tmp_path / where
        run = spec(tiny_model_dir, root, max_off_policy_steps=1, rollouts_on=where)
        if where == "inference_servers":
            run = dataclasses.replace(run, rollout_server=RolloutServer(url=url, token=TOKEN))
        loads = counted_loads(monkeypatch)
        hooks = MeteredHooks()
        assert run_training(run, hooks) == "succeeded"
        runs[where] = (hooks, loads)
    remote, loads = runs["inference_servers"]
    assert len(loads) == 1 < len(runs["worker"][1])  # the trainer's: no sampler copy in the worker
    assert remote.steps == [1, 2, 3, 4]
    for step, metrics in enumerate(remote.metrics, start=1):
        assert {t.metrics["policy_step"] for t in metrics["trajectories"]} == {max(0, step - 2)}
        # The server sampled exactly the checkpoint the trainer saved (fingerprint and probe).
        assert metrics["sampler_logprob_gap"] <= 1e-4
    # Same per-step seeds, same weights: the same rollouts as the sampler in the worker drew.
    local = runs["worker"][0]
    for ours, theirs in zip(remote.metrics, local.metrics, strict=True):
        assert [t.completion_token_ids for t in ours["trajectories"]] == [
            t.completion_token_ids for t in theirs["trajectories"]
        ]
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)


def test_a_run_whose_server_is_gone_fails_saying_so(tiny_model_dir, tmp_path, server):
    url, process = server
    process.terminate()
    process.wait(timeout=20)
    run = dataclasses.replace(
        spec(tiny_model_dir, tmp_path, steps=2, max_off_policy_steps=1, rollouts_on="inference_servers"),
        rollout_server=RolloutServer(url=url, token=TOKEN),
    )
    with pytest.raises(RemoteEngineError, match=f"inference server at {url} cannot be reached"):
        run_training(run, MeteredHooks())


def test_a_recorded_checkpoint_is_named_by_its_store_key_else_by_its_folder(tmp_path):
    keys = {tmp_path / "step-000001": ("models/3/step-000001.tar", "cd" * 32)}
    engine = RemoteEngine(RolloutServer(url="http://x", locate=keys.get), tokenizer=None, stop_token_ids={2})
    engine.load_adapter("a", tmp_path / "step-000001")
    engine.load_adapter("b", tmp_path / "step-000002")
    assert engine._adapters["a"][1] == {
        ADAPTER_KEY_HEADER: "models/3/step-000001.tar",
        ADAPTER_SHA256_HEADER: "cd" * 32,
    }
    assert engine._adapters["b"][1] == {ADAPTER_HEADER: str(tmp_path / "step-000002")}
    assert engine.adapter_path("a") == tmp_path / "step-000001"
