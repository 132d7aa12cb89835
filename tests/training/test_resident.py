"""Sessions kept between client training jobs (training.resident): a job that starts from the kept
session trains exactly as one that loads the same checkpoint from disk, without the load; a stale
or foreign session is never used."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.training.test_client_groups import Sampler, group, trajectory
from training.art_config import art_job_config
from training.client_groups import parse_groups
from training.client_step import ClientStepSpec, train_client_step
from training.config import LoraSpec
from training.resident import ResidentSessions, SessionKey


def key(model: str, step: int, digest: str = "d") -> SessionKey:
    return SessionKey(model=model, step=step, digest=digest, base_model_source="tiny")


def test_only_the_exact_checkpoint_takes_a_kept_session_and_stale_ones_go():
    sessions = ResidentSessions(capacity=2)
    sessions.keep(key("a", 1), "trainer-a1")
    sessions.keep(key("b", 4), "trainer-b4")
    assert sessions.take(key("a", 1, digest="other")) is None  # same step, another checkpoint
    assert len(sessions) == 1  # and a's kept session is gone: stale for good
    sessions.keep(key("a", 2), "trainer-a2")
    sessions.keep(key("c", 1), "trainer-c1")  # capacity 2: the least recently kept (b) goes
    assert sessions.take(key("b", 4)) is None
    assert sessions.take(key("a", 2)) == "trainer-a2" and sessions.take(key("a", 2)) is None  # taken once
    assert (sessions.hits, sessions.misses) == (1, 3)
    off = ResidentSessions(capacity=0)
    off.keep(key("a", 1), "t")
    assert len(off) == 0


def test_a_job_from_the_kept_session_trains_as_one_loaded_from_disk(tiny_model_dir: Path, tmp_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sampler = Sampler(tokenizer)
    prompt = [{"role": "user", "content": "Hi"}]
    groups = parse_groups([group(trajectory([*prompt, sampler.choice(prompt, "hello")], 1.0),
                                 trajectory([*prompt, sampler.choice(prompt, "bye now")], 0.0))])  # fmt: skip

    class Hooks:
        def started(self, *, num_sequences: int) -> None:
            pass

    def spec(root: str, from_step: int, resume_from: Path | None, resident=None) -> ClientStepSpec:
        config, options = art_job_config({"learning_rate": 1e-2})
        return ClientStepSpec(base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
                              checkpoint_root=tmp_path / root, config=config, options=options,
                              lora=LoraSpec(rank=2, alpha=4), groups=groups, from_step=from_step,
                              resume_from=resume_from, resident=resident)  # fmt: skip

    first = train_client_step(spec("a", 0, None), Hooks())
    from_disk = train_client_step(spec("disk", 1, first.path), Hooks())
    kept = train_client_step(spec("kept", 1, first.path, resident=first.trainer), Hooks())
    assert kept.metrics["load_seconds"] < from_disk.metrics["load_seconds"]
    disk_weights = load_file(from_disk.path / "adapter_model.safetensors")
    kept_weights = load_file(kept.path / "adapter_model.safetensors")
    assert all(torch.equal(disk_weights[name], kept_weights[name]) for name in disk_weights)
    disk_state = torch.load(from_disk.path / "optimizer.pt", weights_only=True)["state"]
    kept_state = torch.load(kept.path / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(disk_state[i]["exp_avg"], kept_state[i]["exp_avg"]) for i in disk_state)
    assert kept.metrics["loss"] == from_disk.metrics["loss"]
