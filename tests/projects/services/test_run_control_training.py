"""Pause, resume and fork with real training, in-process on the tiny model (the worker's own code:
``claimed.work_on(TRAINING, ...)``, no broker): a run paused after step 1 and resumed records the
same steps (rewards, losses, gradient norms, sampled trajectories) and ends with the same adapter
weights as an uninterrupted run; a fork's step 0 scores a fixed probe exactly as the source
checkpoint does, and its run loads that copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from django.db import transaction
from safetensors.torch import load_file

from projects import services
from projects.jobs import claimed
from projects.jobs.runs import TRAINING, build_run_spec
from projects.models import Checkpoint, Run, RunStatus, StepMetrics, Trajectory
from tests import factories
from training.runs.steps import checkpoint_path

# Committed rows: the run's heartbeat thread reads them on its own connection.
pytestmark = pytest.mark.django_db(transaction=True)

CONFIG = {
    "steps": 3,
    "group_size": 4,
    "groups_per_step": 2,
    "max_new_tokens": 6,
    "learning_rate": 5e-2,
    "temperature": 1.0,
}
SIMILARITY = {
    "type": "text_similarity",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "evaluation_metric": "fuzzy_match",
}


@pytest.fixture
def world(cast, tiny_model_dir: Path, settings, tmp_path: Path, monkeypatch):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    settings.MODEL_CACHE_DIR = tmp_path / "models"
    settings.RUN_HEARTBEAT_TIMEOUT_S = 30
    settings.TRAINING_DEVICE, settings.TRAINING_ENGINE, settings.TRAINING_UNSLOTH = (
        "cpu",
        "transformers",
        "off",
    )
    enqueued: list[int] = []

    def enqueue(run_id: int) -> None:
        transaction.on_commit(lambda: enqueued.append(run_id))

    monkeypatch.setattr("projects.services.runs._enqueue_run", enqueue)
    base = services.base_model_register(name="tiny", source=str(tiny_model_dir))
    project = factories.ProjectFactory(team=cast.alpha, name="math")
    rows = [{"prompt": f"Say {word}", "item": {"answer": word * 3}} for word in ("ab", "cd", "ef", "gh")]
    inputs = {
        "task_set": factories.TaskSetFactory(project=project, name="say", rows=rows, validation_fraction=0.0),
        "environment": factories.EnvironmentFactory(project=project, name="chat", system_prompt=""),
        "reward": factories.RewardDefinitionFactory(project=project, name="similar", spec=SIMILARITY),
    }

    def new_run(name: str) -> Run:
        model = factories.TrainableModelFactory(
            project=project, name=name, base_model=base, lora={"rank": 4, "alpha": 8}
        )
        return services.run_create(model=model, config=dict(CONFIG), **inputs)

    return type("World", (), {"new_run": staticmethod(new_run), "enqueued": enqueued, "tiny": tiny_model_dir})


def recorded(run: Run) -> list[tuple]:
    return [
        (m.step, m.reward_mean, m.loss, m.metrics["grad_norm"])
        for m in StepMetrics.objects.filter(run=run).order_by("step")
    ]


def samples(run: Run) -> list[tuple]:
    return [
        (t.step, t.group_index, t.sample_index, t.messages[-1]["content"], t.reward)
        for t in Trajectory.objects.filter(run=run).order_by("step", "group_index", "sample_index")
    ]


def adapter(run: Run, step: int) -> dict[str, torch.Tensor]:
    path = Checkpoint.objects.get(model=run.model, step=step).path
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def test_pause_after_step_1_and_resume_equals_an_uninterrupted_run_step_for_step(world, monkeypatch):
    straight = world.new_run("straight")
    assert claimed.work_on(TRAINING, straight.pk) == "succeeded"

    interrupted = world.new_run("paused")
    record = services.step_record

    def record_then_pause(**kwargs):  # a user presses Pause while step 1 is being recorded
        done = record(**kwargs)
        if kwargs["step"] == 1:
            services.run_pause(run=Run.objects.get(pk=interrupted.pk))
        return done

    monkeypatch.setattr(services, "step_record", record_then_pause)
    assert claimed.work_on(TRAINING, interrupted.pk) == "paused"
    paused = Run.objects.get(pk=interrupted.pk)
    assert (paused.status, paused.current_step, paused.worker, paused.heartbeat_at) == (
        RunStatus.PAUSED, 1, "", None,
    )  # fmt: skip
    assert [row[0] for row in recorded(paused)] == [1], "stopped at the step boundary"
    monkeypatch.setattr(services, "step_record", record)

    services.run_resume(run=paused)
    assert world.enqueued[-1] == paused.pk
    assert claimed.work_on(TRAINING, paused.pk) == "succeeded"
    resumed = Run.objects.get(pk=paused.pk)
    assert (resumed.status, resumed.current_step, resumed.attempts) == (RunStatus.SUCCEEDED, 3, 1)

    expected, got = recorded(straight), recorded(resumed)
    assert [row[0] for row in got] == [1, 2, 3]
    assert any(row[2] != 0.0 for row in expected), "the runs must learn for the comparison to mean anything"
    for want, have in zip(expected, got, strict=True):
        assert have[0] == want[0]
        assert have[1:] == pytest.approx(want[1:], rel=1e-5, abs=1e-7), want[0]
    assert samples(resumed) == samples(straight)
    final_straight, final_resumed = adapter(straight, 3), adapter(resumed, 3)
    assert final_straight.keys() == final_resumed.keys()
    assert any(not torch.equal(final_straight[n], adapter(straight, 0)[n]) for n in final_straight)
    for name in final_straight:
        assert torch.allclose(final_resumed[name], final_straight[name], atol=1e-6), name


def probe_logprob(tiny_model_dir: Path, checkpoint_dir: Path) -> float:
    """The summed logprob of a fixed reply to a fixed prompt under the adapter in ``checkpoint_dir``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(checkpoint_dir)
    )
    model.eval()
    prompt = tokenizer("Say ab", return_tensors="pt").input_ids
    reply = tokenizer(" ababab", return_tensors="pt").input_ids
    ids = torch.cat([prompt, reply], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[0, prompt.shape[1] - 1 : -1]
    return float(torch.log_softmax(logits.float(), dim=-1).gather(-1, reply[0][:, None]).sum())


def test_a_forks_step_0_scores_a_probe_exactly_as_the_source_checkpoint(world):
    source = world.new_run("source")
    assert claimed.work_on(TRAINING, source.pk) == "succeeded"
    fork = services.run_fork(run=source, from_step=2, name="fork", config={"steps": 1})
    source_dir = Path(Checkpoint.objects.get(model=source.model, step=2).path)
    fork_dir = Path(Checkpoint.objects.get(model=fork.model, step=0).path)
    assert fork_dir != source_dir
    # Step 2 is not the run's latest: if retention dropped its optimizer state, the fork starts
    # with fresh moments; either way its step 0 has what a resume reads.
    state = json.loads((fork_dir / "state.json").read_text())
    assert state["step"] == 0
    assert state["forked_from"]["fresh_state"] is not (source_dir / "optimizer.pt").is_file()
    assert {"adapter_model.safetensors", "optimizer.pt", "rng_state.pt"} <= {
        p.name for p in fork_dir.iterdir()
    }

    at_source = probe_logprob(world.tiny, source_dir)
    assert probe_logprob(world.tiny, fork_dir) == pytest.approx(at_source, abs=1e-6)
    untrained = probe_logprob(world.tiny, Path(Checkpoint.objects.get(model=source.model, step=0).path))
    assert abs(untrained - at_source) > 1e-4, "the probe must tell trained weights from untrained ones"

    # The fork's run loads exactly that copy and trains on from it.
    spec = build_run_spec(Run.objects.get(pk=fork.pk))
    assert (spec.start_step, spec.resume_step) == (0, 0)
    assert checkpoint_path(spec.checkpoint_root, 0) == fork_dir
    assert claimed.work_on(TRAINING, fork.pk) == "succeeded"
    assert Checkpoint.objects.filter(model=fork.model).count() == 2
