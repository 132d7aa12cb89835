"""The training core on a CUDA device, each path against the CPU path it mirrors: a run in bf16
(rollouts on the GPU, the sampler check every step, checkpoints, resume), a run whose rollouts
overlap the update, one whose rollouts are on an inference server process on the GPU, a run on a
trainer service process on the GPU, SFT and DPO runs, the fp32 update against the CPU's on the same
batch under every named loss, and the data-parallel session over NCCL. Marked ``gpu``: they need
CUDA, not vLLM (benchmarks/gpu_image_check.sh runs them on a GPU host whose image has torch but no
vLLM; ``make test-gpu`` runs them with the rest)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import trainer_service
from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_learning_signal import ROWS
from tests.training.test_service_run import RECIPE
from tests.training.test_supervised import WORDS, Hooks, supervised_spec
from training.config import LoraSpec, TrainConfig
from training.environments import build_environment
from training.runs.loop import run_training
from training.runs.spec import RunSpec
from training.session.contract import Datum
from training.session.local import TrainingSession
from training.session.losses import LOSSES

pytestmark = pytest.mark.gpu

# The fp32 update on the GPU against the CPU's on the same batch: the same math, summed in another
# order by other kernels. Bounds on the loss (relative) and on the adapter after two AdamW steps.
LOSS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-4


@pytest.fixture(autouse=True)
def cuda_device():
    assert torch.cuda.is_available(), "these tests need a CUDA device (run them on a GPU host)"


def run_spec(root: Path, model_dir: Path, **config) -> RunSpec:
    return RunSpec.resolving(
        base_model_source=str(model_dir),
        model_cache_dir=model_dir.parent,
        checkpoint_root=root,
        config=TrainConfig(
            **{
                "steps": 2,
                "group_size": 4,
                "groups_per_step": 2,
                "max_new_tokens": 6,
                "learning_rate": 1e-2,
                **config,
            }
        ),  # fmt: skip
        lora=LoraSpec(rank=2, alpha=4),
        environment=build_environment("chat"),
        grader_spec={"type": "regex", "name": "vowel", "pattern": "[aeiou]"},
        train_rows=ROWS,
        start_step=0,
        resume_step=None,
        device="cuda",
        engine="transformers",
    )


def test_a_bf16_run_on_cuda_checks_its_sampler_every_step_and_resumes(tiny_model_dir, tmp_path):
    hooks = MeteredHooks()
    spec = run_spec(tmp_path, tiny_model_dir)
    assert run_training(spec, hooks) == "succeeded", hooks.events
    assert [m["device_kind"] for m in hooks.metrics] == ["gpu", "gpu"]
    assert all(m["completion_tokens"] > 0 for m in hooks.metrics)
    print("sampler logprob gaps (bf16):", [m["sampler_logprob_gap"] for m in hooks.metrics])
    # The loop checks after every save that the sampler scores a probe as the trainer does (bf16:
    # within 5e-2) and fails the run otherwise; a succeeded run passed every check.
    weights = load_file(tmp_path / "step-000002" / "adapter_model.safetensors")
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    step_one = load_file(tmp_path / "step-000001" / "adapter_model.safetensors")
    assert any(not torch.equal(step_one[k], weights[k]) for k in weights), "step 2 changed nothing"

    resumed = MeteredHooks()
    again = dataclasses.replace(spec, config=dataclasses.replace(spec.config, steps=3), resume_step=2)
    assert run_training(again, resumed) == "succeeded", resumed.events
    assert len(resumed.metrics) == 1 and (tmp_path / "step-000003" / "adapter_model.safetensors").exists()


def test_rollouts_that_overlap_the_update_on_cuda(tiny_model_dir, tmp_path):
    hooks = MeteredHooks()
    assert run_training(run_spec(tmp_path, tiny_model_dir, steps=3, max_off_policy_steps=1), hooks) == (
        "succeeded"
    ), hooks.events
    assert [m["off_policy_steps"] for m in hooks.metrics] == [0.0, 1.0, 1.0]
    print("sampler logprob gaps (overlapped, bf16):", [m["sampler_logprob_gap"] for m in hooks.metrics])
    assert all(m["sampler_logprob_gap"] <= 5e-2 for m in hooks.metrics)


def test_rollouts_on_an_inference_server_on_cuda(tiny_model_dir, tmp_path):
    """``rollouts_on: inference_servers``: the run on the GPU, its rollouts on an inference server
    process whose engine is on the GPU too (POST /generate), every checkpoint checked."""
    from tests.training.test_remote_rollouts import TOKEN, server_process
    from training.engines.remote_engine import RolloutServer

    hooks = MeteredHooks()
    with server_process(tiny_model_dir, tmp_path, device="cuda") as (url, _):
        spec = run_spec(
            tmp_path, tiny_model_dir, steps=3, max_off_policy_steps=1, rollouts_on="inference_servers"
        )
        spec = dataclasses.replace(spec, rollout_server=RolloutServer(url=url, token=TOKEN))
        assert run_training(spec, hooks) == "succeeded", hooks.events
    assert [m["off_policy_steps"] for m in hooks.metrics] == [0.0, 1.0, 1.0]
    print(
        "sampler logprob gaps (rollouts on a CUDA server, bf16):",
        [m["sampler_logprob_gap"] for m in hooks.metrics],
    )
    assert all(m["sampler_logprob_gap"] <= 5e-2 for m in hooks.metrics)


def test_a_run_on_a_trainer_service_on_cuda(tiny_model_dir, tmp_path):
    """The platform's default under ``manage.py up``: the run's session lives in the host's trainer
    service (here on the GPU), with a KL term and two minibatches x two epochs."""
    from training.hosting.resident import ServiceSessions

    with trainer_service(tmp_path, tiny_model_dir.parent, device="cuda") as service:
        run = run_spec(tmp_path / "run", tiny_model_dir, **RECIPE)
        run.host, run.session_id = ServiceSessions(service, holder="worker-1"), "run-1"
        hooks = MeteredHooks()
        assert run_training(run, hooks) == "succeeded", hooks.events
        stats = service.stats()
    assert any("on the trainer service" in event["message"] for event in hooks.events), hooks.events
    assert stats["primitives_run"] > 0 and stats["sessions"] == 0, stats
    print("sampler logprob gaps (service, bf16):", [m["sampler_logprob_gap"] for m in hooks.metrics])
    assert [m["optimizer_steps"] for m in hooks.metrics] == [4.0, 4.0]
    assert all(m["sampler_logprob_gap"] <= 5e-2 for m in hooks.metrics)


def test_sft_and_dpo_runs_on_cuda(tiny_model_dir, tmp_path):
    import math

    rows = [{"prompt": f"Say {w}", "completion": f"{w} {w}", "item": {"word": w}} for w in WORDS]
    sft = Hooks()
    spec = supervised_spec(
        tmp_path / "sft", tiny_model_dir, "sft", rows, rows[:2], learning_rate=2e-2, steps=12
    )
    assert run_training(dataclasses.replace(spec, device="cuda"), sft) == "succeeded", sft.events
    before = next(e for e in sft.events if e["message"].startswith("Held-out before"))["data"]["heldout_loss"]
    after = sft.metrics[-1]["heldout_loss"]
    print(f"SFT on cuda (bf16): held-out loss {before:.3f} -> {after:.3f}")
    assert after < before * 0.7  # the CPU's fp32 run: 6.28 -> 3.75; bf16 here: 6.28 -> 3.79

    rows = [{"prompt": f"Name {w}", "chosen": f"{w} is fine", "rejected": "nothing here", "item": {"word": w}}
            for w in WORDS]  # fmt: skip
    dpo = Hooks()
    spec = supervised_spec(
        tmp_path / "dpo", tiny_model_dir, "dpo", rows, rows[:2], dpo_beta=0.5, learning_rate=5e-3
    )
    assert run_training(dataclasses.replace(spec, device="cuda"), dpo) == "succeeded", dpo.events
    start = next(e for e in dpo.events if e["message"].startswith("Held-out before"))["data"]
    end = dpo.metrics[-1]
    print(f"DPO on cuda (bf16): held-out loss {start['heldout_loss']:.3f} -> {end['heldout_loss']:.3f}, "
          f"preference accuracy {start['heldout_preference_accuracy']} -> {end['heldout_preference_accuracy']}")  # fmt: skip
    assert start["heldout_loss"] == pytest.approx(math.log(2), abs=1e-3)  # the policy is the reference
    assert end["heldout_loss"] < 0.5 * math.log(2) and end["heldout_preference_accuracy"] == 1.0


DATA = [
    Datum(model_input=[5, 9, 14, 3, 22, 7], loss_fn_inputs={
        "target_tokens": [9, 14, 3, 22, 7, 30], "weights": [0, 0, 1, 1, 1, 1],
        "logprobs": [-2.0] * 6, "advantages": [1.0] * 6}),
    Datum(model_input=[5, 9, 40, 41, 42], loss_fn_inputs={
        "target_tokens": [9, 40, 41, 42, 43], "weights": [0, 1, 1, 1, 1],
        "logprobs": [-2.0] * 5, "advantages": [-0.5] * 5}),
    Datum(model_input=[8, 2], loss_fn_inputs={
        "target_tokens": [2, 11], "weights": [1, 1], "logprobs": [-2.0] * 2, "advantages": [2.0] * 2}),
]  # fmt: skip


def fp32_session(model_dir: Path, device: str) -> TrainingSession:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.session.policy import Policy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = TrainConfig(micro_batch_tokens=16, seed=3)
    return TrainingSession(Policy(model, tokenizer, config, LoraSpec(rank=2, alpha=4), device))


def two_updates(session: TrainingSession, loss: str = "ppo") -> dict:
    losses, logprobs = [], []
    for _ in range(2):
        result = session.forward_backward(DATA, loss)
        session.optim_step(learning_rate=1e-3)
        losses.append(result.loss)
        logprobs.append(result.logprobs)
    params = [p.detach().float().cpu() for p in session.trainer.trainable_parameters]
    return {"losses": losses, "logprobs": logprobs, "params": params}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_the_fp32_update_on_cuda_is_the_cpu_update(tiny_model_dir, loss):
    cpu, gpu = (two_updates(fp32_session(tiny_model_dir, device), loss) for device in ("cpu", "cuda"))
    weight_gap = max(float((a - b).abs().max()) for a, b in zip(cpu["params"], gpu["params"], strict=True))
    logprob_gap = max(
        abs(a - b)
        for step_a, step_b in zip(cpu["logprobs"], gpu["logprobs"], strict=True)
        for row_a, row_b in zip(step_a, step_b, strict=True)
        for a, b in zip(row_a, row_b, strict=True)
    )
    print(f"{loss}: cpu vs cuda fp32: losses {cpu['losses']} vs {gpu['losses']}, largest logprob gap "
          f"{logprob_gap:.2e}, largest adapter weight gap {weight_gap:.2e}")  # fmt: skip
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=LOSS_TOLERANCE, abs=1e-6)
    assert logprob_gap < 1e-4
    assert weight_gap < WEIGHT_TOLERANCE
    assert any(float(p.abs().max()) > 0 for p in gpu["params"])


def _nccl_rank(rank: int, world_size: int, model_dir: str, out: str) -> None:
    from training.hosting.ranks import DataParallelSession

    parallel = DataParallelSession(fp32_session(Path(model_dir), "cuda"))
    losses = []
    for _ in range(2):
        losses.append(parallel.forward_backward(DATA, "ppo").loss)
        parallel.optim_step(learning_rate=1e-3)
    torch.save({"losses": losses, "params": [p.detach().cpu() for p in parallel.parameters]},
               Path(out) / f"rank-{rank}.pt")  # fmt: skip


def test_the_data_parallel_session_runs_over_nccl(tiny_model_dir, tmp_path):
    """One GPU here, so one NCCL rank (NCCL refuses two ranks on one device): the collectives, the
    broadcast of rank 0's adapter and the gradient reduction run over NCCL and change nothing."""
    from training.hosting.ranks import backend_for, run_ranks

    assert backend_for("cuda") == "nccl"
    run_ranks(_nccl_rank, 1, str(tiny_model_dir), str(tmp_path), rendezvous=tmp_path / "rendezvous",
              backend="nccl")  # fmt: skip
    parallel = torch.load(tmp_path / "rank-0.pt", weights_only=True)
    alone = two_updates(fp32_session(tiny_model_dir, "cuda"))
    assert parallel["losses"] == pytest.approx(alone["losses"], rel=1e-6)
    gap = max(float((a - b).abs().max()) for a, b in zip(parallel["params"], alone["params"], strict=True))
    assert gap < 1e-6, gap
