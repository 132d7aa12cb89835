"""An overlapped run whose rollouts are sampled on an inference server (``rollouts_on:
inference_servers``, training.engines.remote_engine): a real server process of the tiny model
(``POST /generate``), the run in this process. The worker loads the base model once (the trainer's);
every checkpoint the rollouts use is the server's, checked against the trainer's policy when it was
saved; the run trains exactly as the same run with its sampler in the worker."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import training.hosting.in_process as in_process
import training.runs.sampler as policy_sampler
from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_overlap import spec
from tests.training.vllm_double import VLLMDouble
from training.engines.remote_engine import RemoteEngine, RemoteEngineError, RolloutServer
from training.runs.loop import run_training
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
    real = in_process.load_policy_model

    def counting(source, cache, **kwargs):
        loads.append(source)
        return real(source, cache, **kwargs)

    monkeypatch.setattr(in_process, "load_policy_model", counting)  # the trainer's (a run in the worker)
    monkeypatch.setattr(policy_sampler, "load_policy_model", counting)  # a detached sampler's
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


# ------------------------------------------------------------------ vLLM's dialect (a double)
@contextlib.contextmanager
def vllm_host(
    tiny_model_dir: Path, host_root: Path
) -> Iterator[tuple[VLLMDouble, str, str, dict[str, Path]]]:
    """A vLLM double of the tiny model whose disk is ``host_root``, and its host's checkpoint
    fetcher (the real one) copying from a store into that disk: (double, its URL, the fetcher's
    URL, the store: key -> the writer's folder)."""
    from training.base_models import load_base_model
    from training.engines.transformers_engine import TransformersEngine
    from training.serving.fetch_cache import FetchedCheckpoints
    from training.serving.fetch_server import start_fetch_server

    store: dict[str, Path] = {}

    def fetch(key: str, sha256: str) -> Path:
        if key not in store:
            raise FileNotFoundError(key)
        if sha256 != digest_of(key):
            raise ValueError("contents have another digest")
        local = host_root / "cache" / key.replace("/", "--")
        if not local.exists():
            shutil.copytree(store[key], local)
        return local

    model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
    double = VLLMDouble(
        TransformersEngine(model, tokenizer), served_model="tiny", host_root=host_root, token=TOKEN
    )
    url = double.start()
    fetcher = start_fetch_server(FetchedCheckpoints(fetch, root=None), host="127.0.0.1", port=0, token=TOKEN)
    try:
        yield double, url, f"http://127.0.0.1:{fetcher.server_address[1]}", store
    finally:
        fetcher.shutdown()
        double.stop()


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def vllm_rollouts(url: str, fetch_url: str, store: dict[str, Path]) -> RolloutServer:
    def locate(folder: Path) -> tuple[str, str]:  # every checkpoint recorded: named by its store key
        key = f"model-1/{folder.name}"
        store[key] = folder
        return key, digest_of(key)

    return RolloutServer(url=url, token=TOKEN, locate=locate, engine="vllm", fetch_url=fetch_url,
                         served_model="tiny", adapter_prefix="run-7-")  # fmt: skip


def test_an_overlapped_run_samples_its_rollouts_on_a_vllm_server(tiny_model_dir, tmp_path, monkeypatch):
    host = tmp_path / "vllm-host"
    with vllm_host(tiny_model_dir, host) as (double, url, fetch_url, store):
        run = dataclasses.replace(
            spec(tiny_model_dir, tmp_path / "run", max_off_policy_steps=1, rollouts_on="inference_servers"),
            rollout_server=vllm_rollouts(url, fetch_url, store),
        )
        loads = counted_loads(monkeypatch)
        hooks = MeteredHooks()
        assert run_training(run, hooks) == "succeeded"
    assert len(loads) == 1  # the trainer's: no sampler copy in the worker
    assert hooks.steps == [1, 2, 3, 4]
    for step, metrics in enumerate(hooks.metrics, start=1):
        assert {t.metrics["policy_step"] for t in metrics["trajectories"]} == {max(0, step - 2)}
        # vLLM's dialect sampled exactly the checkpoint the trainer saved, at the trainer's logprobs.
        assert metrics["sampler_logprob_gap"] <= 1e-4
        # Seeded per prompt: a step's 8 samples (2 prompts × 4) are not 2 samples repeated.
        assert len({tuple(t.completion_token_ids) for t in metrics["trajectories"]}) > 2
    loaded = [body for path, body in double.requests if path == "/v1/load_lora_adapter"]
    print("loaded", [body["lora_name"] for body in loaded])
    assert [body["lora_name"] for body in loaded][:3] == ["run-7-step-0", "run-7-step-1", "run-7-step-2"]
    # Every folder vLLM loaded is on its own host's disk, fetched there by store key.
    assert all(Path(body["lora_path"]).is_relative_to(host / "cache") for body in loaded)
    # The run unloads what it moved past, and what it held at the end: vLLM keeps none of its adapters.
    unloaded = [body["lora_name"] for path, body in double.requests if path == "/v1/unload_lora_adapter"]
    assert "run-7-step-0" in unloaded and double.loaded == {}
    completions = [body for path, body in double.requests if path == "/v1/completions"]
    rollouts = [body for body in completions if body["temperature"] == 1.0]
    assert len(rollouts) == 4 * 8  # one request per prompt (the rest: the greedy evaluation and probes)
    assert all(len(body["prompt"]) == 1 and body["return_tokens_as_token_ids"] for body in rollouts)
    assert len({body["seed"] for body in rollouts}) == len(rollouts)


def test_the_vllm_dialect_reloads_a_forgotten_adapter_and_says_what_it_cannot_do(tiny_model_dir, tmp_path):
    from training.base_models import load_base_model
    from training.config import LoraSpec, TrainConfig
    from training.engines.base import SamplingParams
    from training.session.policy import Policy

    host = tmp_path / "vllm-host"
    with vllm_host(tiny_model_dir, host) as (double, url, fetch_url, store):
        model, tokenizer = load_base_model(str(tiny_model_dir), tiny_model_dir.parent)
        trainer = Policy(model, tokenizer, TrainConfig(), LoraSpec(rank=2, alpha=4))
        trainer.save_checkpoint(tmp_path / "step-000001", step=1, metrics={})
        engine = RemoteEngine(
            vllm_rollouts(url, fetch_url, store), tokenizer, stop_token_ids={tokenizer.eos_token_id}
        )
        engine.load_adapter("step-1", tmp_path / "step-000001")
        prompts = [[5, 6, 7], [5, 6, 7], [8, 9]]
        unseeded = SamplingParams(max_new_tokens=4, top_logprobs=2)
        first = engine.generate_from_tokens(prompts, unseeded, "step-1")
        # Unseeded: one request for the batch; each token's two alternatives, most likely first.
        assert [len(body["prompt"]) for path, body in double.requests if path == "/v1/completions"] == [3]
        assert all(len(row) == 2 and row[0][1] >= row[1][1] for c in first for row in c.top_logprobs)
        # A restarted vLLM has forgotten the adapter: loaded again, the request answered.
        double.forget_adapters()
        again = engine.generate_from_tokens(prompts, SamplingParams(max_new_tokens=4, seed=3), "step-1")
        assert len(again) == 3 and all(c.logprobs for c in again)
        assert [b["lora_name"] for p, b in double.requests if p == "/v1/load_lora_adapter"] == [
            "run-7-step-1"
        ] * 2
        with pytest.raises(ValueError, match="top-p, top-k or min-p"):
            engine.generate_from_tokens(prompts, SamplingParams(top_p=0.9), "step-1")
        # A checkpoint the store does not hold: the fetcher's answer, named.
        engine.server.locate = lambda folder: ("model-1/step-000009", digest_of("model-1/step-000009"))
        with pytest.raises(RemoteEngineError, match="checkpoint fetcher at .* answered 404"):
            engine.load_adapter("step-9", tmp_path / "step-000009")


def test_a_vllm_answer_that_is_not_one_logprobbed_completion_per_prompt_is_refused():
    from training.engines.remote_engine import choices_of_vllm

    def answer(tokens, values, finish="stop", top=None, index=0):
        logprobs = {"tokens": tokens, "token_logprobs": values, "top_logprobs": top}
        return {"choices": [{"index": index, "text": "x", "logprobs": logprobs, "finish_reason": finish}]}

    (choice,) = choices_of_vllm([[1]], answer(["token_id:7", "token_id:2"], [-0.5, -0.1]), 0)
    assert (choice.token_ids, choice.logprobs, choice.finish_reason) == ([7, 2], [-0.5, -0.1], "stop")
    top = [{"token_id:7": -0.5, "token_id:3": -1.0, "token_id:4": -0.2}]
    (choice,) = choices_of_vllm([[1]], answer(["token_id:7"], [-0.5], top=top), 2)
    assert choice.top_logprobs == [[(4, -0.2), (7, -0.5)]]
    for bad, message in (
        (answer(["hello"], [-0.5]), "ignored return_tokens_as_token_ids"),
        (answer(["token_id:7"], [None]), "without its logprob"),
        (answer(["token_id:7", "token_id:8"], [-0.5]), "without a logprob per token"),
        (answer(["token_id:7"], [-0.5], finish="abort"), "did not finish"),
        (answer(["token_id:7"], [-0.5], index=1), "1 completions for 2 prompts"),
    ):
        with pytest.raises(RemoteEngineError, match=message):
            choices_of_vllm([[1], [2]] if "2 prompts" in message else [[1]], bad, 0)
