"""Platform runs on the host's trainer service (issue 25, item 3; training.hosting.service_run): the worker
holds no model, the run's session lives in the service, and it trains the tensors a run in the
worker trains; a service that restarts mid-run costs the steps since the last checkpoint, not the run."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import trainer_service
from tests.training.test_cost_loop import MeteredHooks
from tests.training.test_overlap import spec
from training.hosting.resident import ServiceSessions
from training.hosting.service_run import service_refusal
from training.runs.loop import run_training
from training.runs.steps import checkpoint_path
from training.session.checkpoint_files import ADAPTER_WEIGHTS

# A KL term (the base model's logprobs through ``forward``) and two minibatches (two optimizer
# steps a step, in a seeded order on the second pass) take every path of the update.
RECIPE = {"kl_coef": 0.05, "num_minibatches": 2, "ppo_epochs": 2}


def adapters(root, steps) -> list[dict[str, torch.Tensor]]:
    return [load_file(checkpoint_path(root, step) / ADAPTER_WEIGHTS) for step in steps]


def assert_same_tensors(ours, theirs) -> None:
    for step, (mine, other) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.keys() == other.keys()
        differ = [name for name in mine if not torch.equal(mine[name], other[name])]
        assert not differ, f"checkpoint {step}: {differ[:3]} differ"


def test_a_run_on_the_trainer_service_trains_what_a_run_in_the_worker_trains(
    tiny_model_dir, tmp_path, one_thread
):
    local = MeteredHooks()
    assert run_training(spec(tiny_model_dir, tmp_path / "local", steps=3, **RECIPE), local) == "succeeded"
    with trainer_service(tmp_path, tiny_model_dir.parent) as service:
        run = spec(tiny_model_dir, tmp_path / "service", steps=3, **RECIPE)
        run.host, run.session_id = ServiceSessions(service, holder="worker-1"), "run-1"
        assert service_refusal(run) is None
        hooks = MeteredHooks()
        assert run_training(run, hooks) == "succeeded"
        stats = service.stats()
    assert hooks.steps == [1, 2, 3]
    assert stats["primitives_run"] > 0 and stats["sessions"] == 0, stats  # closed at the end
    assert any("on the trainer service" in event["message"] for event in hooks.events), hooks.events
    for step, (mine, theirs) in enumerate(zip(hooks.metrics, local.metrics, strict=True), start=1):
        assert [t.completion_token_ids for t in mine["trajectories"]] == [
            t.completion_token_ids for t in theirs["trajectories"]
        ], f"step {step} sampled other tokens"
        assert mine["loss"] == theirs["loss"] and mine["kl"] == theirs["kl"]
        assert mine["optimizer_steps"] == 4.0
        assert mine["sampler_logprob_gap"] <= 1e-4
    assert any(m["trainable_tokens"] > 0 for m in local.metrics), "no update: equal tensors would say nothing"
    assert_same_tensors(adapters(tmp_path / "service", range(4)), adapters(tmp_path / "local", range(4)))
    # The evaluations sampled the service's policy as the worker's did.
    assert [e["reward_mean"] for e in hooks.evaluations] == [e["reward_mean"] for e in local.evaluations]


class RestartsService(MeteredHooks):
    """Kills the trainer service once step ``at`` is recorded, and starts another on its port."""

    def __init__(self, stack: contextlib.ExitStack, first: Any, start: Any, at: int) -> None:
        super().__init__()
        self.stack, self.first, self.start, self.at = stack, first, start, at

    def record_step(self, *, step, metrics, trajectories, path) -> bool:
        recorded = super().record_step(step=step, metrics=metrics, trajectories=trajectories, path=path)
        if step == self.at:
            self.first.process.kill()
            self.first.process.wait()
            self.stack.enter_context(self.start())
        return recorded


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_run_whose_trainer_service_restarts_continues_from_its_last_checkpoint(
    tiny_model_dir, tmp_path, one_thread
):
    local = MeteredHooks()
    assert run_training(spec(tiny_model_dir, tmp_path / "local", steps=4), local) == "succeeded"
    port = free_port()

    def start():
        return trainer_service(tmp_path, tiny_model_dir.parent, port=port)

    with contextlib.ExitStack() as stack:
        first = stack.enter_context(start())
        run = spec(tiny_model_dir, tmp_path / "service", steps=4)
        run.host, run.session_id = ServiceSessions(first, holder="worker-1"), "run-7"
        hooks = RestartsService(stack, first, start, at=2)
        assert run_training(run, hooks) == "succeeded"
    assert hooks.steps == [1, 2, 3, 4]  # every step once: step 3 was not recorded before the loss
    warned = [event["message"] for event in hooks.events if event["level"] == "warn"]
    assert any("continues from checkpoint step 2 on a new session" in message for message in warned), warned
    assert any("Resumed from checkpoint step 2" in event["message"] for event in hooks.events)
    assert_same_tensors(adapters(tmp_path / "service", range(5)), adapters(tmp_path / "local", range(5)))


def test_runs_the_service_does_not_take_train_in_the_worker_and_say_why(tiny_model_dir, tmp_path):
    run = spec(tiny_model_dir, tmp_path, steps=1)
    assert service_refusal(run) == "no trainer service on this host"
    run.host, run.session_id = ServiceSessions(object(), holder="w"), "run-1"
    assert service_refusal(run) is None
    for config, reason in (({"max_off_policy_steps": 1}, "overlap"), ({"devices": 2}, "data-parallel")):
        other = spec(tiny_model_dir, tmp_path, steps=1, **config)
        other.host = run.host
        assert reason in (service_refusal(other) or "")
    other = spec(tiny_model_dir, tmp_path, steps=1)
    other.host, other.objective = run.host, "dpo"
    assert service_refusal(other) is None
    # Without a service the engine is not chosen here: a vLLM run whose vLLM lives in another
    # virtualenv (VLLM_PYTHON, which the sampler is given) is not refused for lacking it in this one.
    vllm_run = spec(tiny_model_dir, tmp_path, steps=1)
    vllm_run.engine, vllm_run.vllm_python = "vllm", "/nonexistent/python"
    assert service_refusal(vllm_run) == "no trainer service on this host"


def test_a_service_that_does_not_answer_leaves_the_run_in_the_worker_with_a_warning(tiny_model_dir, tmp_path):
    from training.hosting.client import TrainerServiceClient

    run = spec(tiny_model_dir, tmp_path, steps=1)
    run.host = ServiceSessions(TrainerServiceClient(f"http://127.0.0.1:{free_port()}"), holder="w")
    hooks = MeteredHooks()
    assert run_training(run, hooks) == "succeeded" and hooks.steps == [1]
    warned = [event["message"] for event in hooks.events if event["level"] == "warn"]
    assert any("trains in the worker" in message for message in warned), warned


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_sft_and_dpo_runs_on_the_trainer_service_train_what_they_train_in_the_worker(
    objective, tiny_model_dir, tmp_path, one_thread
):
    from tests.training.test_supervised import WORDS, Hooks, supervised_spec

    target = {"sft": "completion", "dpo": "chosen"}[objective]
    rows = [{"prompt": f"Say {w}", target: f"{w} {w}", "item": {"word": w}} for w in WORDS]
    if objective == "dpo":
        rows = [{**row, "rejected": "nothing here"} for row in rows]
    local = Hooks()
    config = {"steps": 3, "learning_rate": 2e-2}
    assert run_training(supervised_spec(tmp_path / "local", tiny_model_dir, objective, rows, rows[:2], **config),
                        local) == "succeeded"  # fmt: skip
    with trainer_service(tmp_path, tiny_model_dir.parent) as service:
        run = supervised_spec(tmp_path / "service", tiny_model_dir, objective, rows, rows[:2], **config)
        run.host, run.session_id = ServiceSessions(service, holder="worker-1"), "run-2"
        hooks = Hooks()
        assert run_training(run, hooks) == "succeeded"
    assert any("on the trainer service" in event["message"] for event in hooks.events)
    assert [m["loss"] for m in hooks.metrics] == [m["loss"] for m in local.metrics]
    assert [m.get("heldout_loss") for m in hooks.metrics] == [m.get("heldout_loss") for m in local.metrics]
    assert hooks.metrics[-1]["heldout_loss"] > 0
    graded = [(e["step"], e["reward_mean"]) for e in hooks.evaluations]
    assert graded == [(e["step"], e["reward_mean"]) for e in local.evaluations] and len(graded) == 2
    assert_same_tensors(adapters(tmp_path / "service", range(4)), adapters(tmp_path / "local", range(4)))


def test_one_rule_places_runs_and_client_work():
    """training.hosting.placement: without a service everything stays in the worker; client work
    (ART jobs, Tinker clients) goes to the service even data-parallel (its pool starts the ranks);
    a run goes there unless it needs the worker, and says why."""
    from training.config import TrainConfig
    from training.hosting.placement import SERVICE, WORKER, place

    plain, parallel = TrainConfig(), TrainConfig(devices=2)
    assert place("client", service=False).host == WORKER
    assert place("run", service=False, config=plain).host == WORKER
    assert place("client", service=True).host == SERVICE
    assert place("run", service=True, config=plain).host == SERVICE
    assert "data-parallel" in place("run", service=True, config=parallel).reason
    assert place("run", service=True, config=parallel).host == WORKER
    assert place("run", service=True, config=TrainConfig(max_off_policy_steps=1)).host == WORKER
    assert "vLLM" in place("run", service=True, config=plain, sampler="vllm").reason
    with pytest.raises(ValueError, match="config"):
        place("run", service=True)
