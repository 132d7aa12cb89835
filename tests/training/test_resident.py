"""Sessions kept between client training jobs (training.hosting.resident): a job that starts from the kept
session trains exactly as one that loads the same checkpoint from disk, without the load; a stale
or foreign session is never used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tests.training.test_client_groups import Sampler, group, trajectory
from training.base_models import load_base_model
from training.config import LoraSpec
from training.hosting.resident import ResidentSessions, SessionKey
from training.recipes.art_config import art_job_config
from training.runs.art_groups import parse_groups
from training.runs.art_step import ClientStepSpec, train_client_step


def load(source: str):
    return load_base_model(source, cache_dir=Path(source).parent)


def test_only_the_exact_checkpoint_takes_a_kept_session_and_stale_ones_go(
    tiny_model_dir: Path, tmp_path: Path
):
    source = str(tiny_model_dir)
    sessions = ResidentSessions(load, capacity=2, spill_dir=tmp_path / "spill")

    def key(model: str, step: int, digest: str = "d") -> SessionKey:
        return SessionKey(model=model, step=step, digest=digest, base_model_source=source)

    def job(model: str, step: int, *, digest: str = "d", recorded: bool = True):
        spec = ClientStepSpec(base_model_source=source, model_cache_dir=tmp_path, checkpoint_root=tmp_path,
                              config=art_job_config({})[0], lora=LoraSpec(rank=2, alpha=4), groups=[],
                              from_step=step, resume_from=None)  # fmt: skip
        sessions.attach(spec, key(model, step, digest))
        assert spec.session.trainer.step == step and spec.tokenizer is not None and spec.model_max
        sessions.settle(model, key(model, step + 1, digest) if recorded else None)
        return spec.session.trainer

    a = job("a", 0)
    assert job("a", 1) is a  # the step it recorded: kept
    assert job("a", 2, digest="other") is not a  # same model, another checkpoint: loaded afresh
    job("b", 0)
    job("c", 0)  # capacity 2: the least recently used (a) goes
    assert sorted(sessions.pool.sessions()) == ["b", "c"] and len(sessions) == 2
    job("b", 1, recorded=False)  # a job that did not record closes its session
    assert "b" not in sessions.pool
    assert (sessions.hits, sessions.misses) == (2, 4)
    assert sessions.pool.stats()["base_loads"] == 1  # every model's adapter on one copy of the base
    off = ResidentSessions(load, capacity=0, spill_dir=tmp_path / "off")
    spec = ClientStepSpec(base_model_source=source, model_cache_dir=tmp_path, checkpoint_root=tmp_path,
                          config=art_job_config({})[0], lora=LoraSpec(rank=2, alpha=4), groups=[],
                          from_step=0, resume_from=None)  # fmt: skip
    off.attach(spec, key("a", 0))
    off.settle("a", key("a", 1))
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

    def spec(root: str, from_step: int, resume_from: Path | None, kept=None) -> ClientStepSpec:
        config, options = art_job_config({"learning_rate": 1e-2})
        spec = ClientStepSpec(base_model_source=str(tiny_model_dir), model_cache_dir=tmp_path / "cache",
                              checkpoint_root=tmp_path / root, config=config, options=options,
                              lora=LoraSpec(rank=2, alpha=4), groups=groups, from_step=from_step,
                              resume_from=resume_from)  # fmt: skip
        if kept is not None:
            spec.session, spec.tokenizer, spec.model_max = kept.session, tokenizer, 1024
        return spec

    first = train_client_step(spec("a", 0, None), Hooks())
    from_disk = train_client_step(spec("disk", 1, first.path), Hooks())
    kept = train_client_step(spec("kept", 1, first.path, kept=first), Hooks())
    assert kept.metrics["load_seconds"] < from_disk.metrics["load_seconds"]
    disk_weights = load_file(from_disk.path / "adapter_model.safetensors")
    kept_weights = load_file(kept.path / "adapter_model.safetensors")
    assert all(torch.equal(disk_weights[name], kept_weights[name]) for name in disk_weights)
    disk_state = torch.load(from_disk.path / "optimizer.pt", weights_only=True)["state"]
    kept_state = torch.load(kept.path / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(disk_state[i]["exp_avg"], kept_state[i]["exp_avg"]) for i in disk_state)
    assert kept.metrics["loss"] == from_disk.metrics["loss"]


def test_service_sessions_reload_a_stale_session_and_refuse_a_held_one(
    tiny_model_dir: Path, tmp_path: Path, live_service
):
    from training.hosting.client import LeaseLost
    from training.hosting.resident import ServiceSessions
    from training.model_files import context_length

    source = str(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(source)
    sessions = ServiceSessions(live_service, holder="worker-1",
                               load_tokenizer=lambda s: (tokenizer, context_length(s, tmp_path)))  # fmt: skip

    def spec(step: int) -> ClientStepSpec:
        return ClientStepSpec(base_model_source=source, model_cache_dir=tmp_path, checkpoint_root=tmp_path,
                              config=art_job_config({})[0], lora=LoraSpec(rank=2, alpha=4), groups=[],
                              from_step=step, resume_from=None)  # fmt: skip

    def key(step: int, digest: str = "d") -> SessionKey:
        return SessionKey(model="model-7", step=step, digest=digest, base_model_source=source)

    first = spec(0)
    sessions.attach(first, key(0))  # none on the service: opened
    assert first.tokenizer is tokenizer and first.model_max == 1024
    sessions.settle("model-7", key(1))
    assert live_service.stats()["held"] == {}
    again = spec(1)
    sessions.attach(again, key(1))  # the tag it was left with: a hit
    sessions.settle("model-7", key(2))
    stale = spec(2)
    sessions.attach(stale, key(2, digest="remade"))  # another checkpoint at that step: 412, closed, reopened
    assert (sessions.hits, sessions.misses) == (1, 2)
    # While worker-1 holds it, another worker's claim is refused, and says why.
    other = ServiceSessions(live_service, holder="worker-2", load_tokenizer=lambda s: (tokenizer, None))
    with pytest.raises(LeaseLost, match="held by another holder"):
        other.attach(spec(2), key(2, digest="remade"))
    sessions.settle("model-7", None)  # a failed job closes its session
    assert live_service.stats()["sessions"] == 0
