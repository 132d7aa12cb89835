"""Pause, resume and fork as services (the state machine, without training): a running run pauses
only at the worker's next step boundary and is then given up, a queued one pauses at once, resume
queues it after commit with its claim count reset; where a new run starts (``start_from``) is
fixed at creation and said in its first event; a fork copies the checkpoint as its model's step 0.
The training side (pause/resume equals an uninterrupted run, the fork's weights) is in
test_run_control_training.py."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import transaction
from django.utils import timezone

from projects import selectors, services
from projects.errors import Conflict, InvalidTransition, ValidationFailed
from projects.jobs.runs import build_run_spec
from projects.models import Checkpoint, Run, RunEvent, RunStatus, TrainableModel
from tests import factories


@pytest.fixture
def enqueued(monkeypatch) -> list[int]:
    """Runs the services enqueue after commit (a test's transaction never commits: capture the
    callbacks to run them), kept here instead of sent to a broker."""
    sent: list[int] = []

    def enqueue(run_id: int) -> None:
        transaction.on_commit(lambda: sent.append(run_id))

    monkeypatch.setattr("projects.services.runs._enqueue_run", enqueue)
    return sent


def create(alpha_setup, **kwargs) -> Run:
    return services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
        config={"steps": 3},
        **kwargs,
    )


def claimed(run: Run, worker: str = "w1") -> Run:
    got = services.run_claim(run_id=run.pk, worker=worker)
    assert got is not None
    return got


def messages(run: Run) -> list[str]:
    return list(RunEvent.objects.filter(run=run).order_by("id").values_list("message", flat=True))


# --- pause / resume ------------------------------------------------------------------------------


def test_runs_a_stopped_stack_left_running_are_paused_for_the_user_to_resume(alpha_setup, enqueued):
    # manage.py up on its own database: a run that was running when the platform stopped waits
    # for the user, instead of training again unannounced once the next stack's worker is free.
    interrupted = claimed(create(alpha_setup))
    Run.objects.filter(pk=interrupted.pk).update(current_step=2)
    waiting = services.run_create(
        model=factories.TrainableModelFactory(project=alpha_setup.project, name="other", base_model=alpha_setup.base),
        task_set=alpha_setup.task_set, environment=alpha_setup.environment, reward=alpha_setup.reward,
        config={"steps": 3},
    )  # fmt: skip
    assert services.runs_pause_interrupted() == [interrupted.pk]
    interrupted.refresh_from_db()
    assert (interrupted.status, interrupted.worker, interrupted.heartbeat_at) == (RunStatus.PAUSED, "", None)
    assert (
        "The platform stopped while this run was running; paused at checkpoint step 2"
        in messages(interrupted)[-1]
    )
    assert f"/api/v1/runs/{interrupted.pk}/resume/" in messages(interrupted)[-1]
    waiting.refresh_from_db()
    assert waiting.status == RunStatus.QUEUED  # a queued run is still taken as usual
    assert services.run_resume(run=interrupted).status == RunStatus.QUEUED


def test_a_running_run_pauses_only_at_the_workers_next_step_boundary(alpha_setup, enqueued):
    run = claimed(create(alpha_setup))
    paused = services.run_pause(run=run)
    assert paused.status == RunStatus.RUNNING and paused.pause_requested
    assert selectors.run_stop_reason(run_id=run.pk, worker="w1") == "paused"
    assert services.run_pause(run=run).pause_requested  # asking twice changes nothing
    assert messages(run).count("Pause requested; the run pauses after its current step") == 1

    assert services.run_pause_finish(run_id=run.pk, worker="another") is None  # not its owner
    Run.objects.filter(pk=run.pk).update(current_step=1)
    finished = services.run_pause_finish(run_id=run.pk, worker="w1")
    assert finished is not None and finished.status == RunStatus.PAUSED
    assert (finished.worker, finished.heartbeat_at, finished.pause_requested) == ("", None, False)
    event = RunEvent.objects.filter(run=run).last()
    assert event is not None and event.data == {"from": "running", "to": "paused", "step": 1, "worker": "w1"}
    assert services.run_claim(run_id=run.pk, worker="w2") is None, "a paused run is not claimed"


def test_resume_queues_after_commit_and_the_next_claim_continues_from_the_last_step(
    alpha_setup, enqueued, django_capture_on_commit_callbacks
):
    run = claimed(create(alpha_setup))
    services.checkpoint_record(model=alpha_setup.model, run=run, step=0, path="/ckpt/0")
    services.checkpoint_record(model=alpha_setup.model, run=run, step=1, path="/ckpt/1")
    Run.objects.filter(pk=run.pk).update(current_step=1, attempts=3)
    services.run_pause(run=run)
    services.run_pause_finish(run_id=run.pk, worker="w1")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        resumed = services.run_resume(run=run)
    assert (resumed.status, resumed.attempts) == (RunStatus.QUEUED, 0)
    assert enqueued == [] and len(callbacks) == 1, "enqueued only once the transaction commits"
    callbacks[0]()
    assert enqueued == [run.pk]
    again = claimed(resumed, "w2")
    assert again.attempts == 1, "a pause is not a lost worker: the cap counts from the resume"
    spec = build_run_spec(again)
    assert (spec.start_step, spec.resume_step) == (0, 1)
    assert "Run resumed: queued to continue from checkpoint step 1" in messages(run)


def test_a_pausing_run_whose_worker_died_is_paused_not_resumed_elsewhere(alpha_setup, enqueued):
    run = claimed(create(alpha_setup))
    services.run_pause(run=run)
    Run.objects.filter(pk=run.pk).update(current_step=2, heartbeat_at=timezone.now() - timedelta(hours=1))
    assert services.runs_requeue_orphaned(stale_after_s=60) == [run.pk]
    assert services.run_claim(run_id=run.pk, worker="w2", stale_after_s=60) is None
    paused = Run.objects.get(pk=run.pk)
    assert (paused.status, paused.worker, paused.attempts) == (RunStatus.PAUSED, "", 1)
    assert (
        "stopped sending heartbeats while the run was pausing; paused at checkpoint step 2"
        in messages(run)[-1]
    )


def test_a_queued_run_pauses_at_once_and_its_queued_message_is_then_skipped(alpha_setup, enqueued):
    run = create(alpha_setup)
    assert services.run_pause(run=run).status == RunStatus.PAUSED
    assert services.run_claim(run_id=run.pk, worker="w1") is None
    assert services.run_resume(run=run).status == RunStatus.QUEUED
    assert claimed(run).status == RunStatus.RUNNING


@pytest.mark.parametrize("status", [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED])
def test_a_finished_run_cannot_be_paused_or_resumed(alpha_setup, enqueued, status):
    run = create(alpha_setup)
    Run.objects.filter(pk=run.pk).update(status=status)
    with pytest.raises(InvalidTransition, match=f"a {status} run cannot be paused"):
        services.run_pause(run=run)
    with pytest.raises(InvalidTransition, match="only a paused run can be resumed"):
        services.run_resume(run=run)


def test_resume_of_a_running_run_and_pause_of_a_paused_or_cancelling_one_are_refused(alpha_setup, enqueued):
    run = claimed(create(alpha_setup))
    with pytest.raises(InvalidTransition, match="this one is running"):
        services.run_resume(run=run)
    services.run_cancel(run=run)
    with pytest.raises(InvalidTransition, match="being cancelled"):
        services.run_pause(run=run)
    other = factories.RunFactory(model=factories.TrainableModelFactory(project=alpha_setup.project))
    services.run_pause(run=other)
    with pytest.raises(InvalidTransition, match="a paused run cannot be paused"):
        services.run_pause(run=other)


def test_a_cancellation_that_arrives_while_pausing_wins(alpha_setup, enqueued):
    run = claimed(create(alpha_setup))
    services.run_pause(run=run)
    Run.objects.filter(pk=run.pk).update(cancel_requested=True)  # asked between the check and the end
    assert selectors.run_stop_reason(run_id=run.pk, worker="w1") == "cancelled"
    finished = services.run_pause_finish(run_id=run.pk, worker="w1")
    assert finished is not None and finished.status == RunStatus.CANCELLED


def test_a_paused_run_can_be_cancelled_and_still_blocks_a_new_run_on_its_model(alpha_setup, enqueued):
    run = create(alpha_setup)
    services.run_pause(run=run)
    with pytest.raises(Conflict, match="already has an active run"):
        create(alpha_setup)
    assert services.run_cancel(run=run).status == RunStatus.CANCELLED


def test_a_client_run_has_nothing_to_pause_resume_or_fork(cast, enqueued):
    services.base_model_register(name="tiny", source="/nonexistent/tiny")
    _, run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="agent", base_model="tiny"
    )
    for action in (services.run_pause, services.run_resume):
        with pytest.raises(Conflict, match="client run") as caught:
            action(run=run)
        assert caught.value.code == "client_run"
    with pytest.raises(Conflict, match="client run"):
        services.run_fork(run=run, from_step=0, name="copy")


# --- start_from ----------------------------------------------------------------------------------


def test_latest_is_the_default_fixed_at_creation_and_said_in_the_first_event(alpha_setup, enqueued):
    fresh = create(alpha_setup)
    assert fresh.start_step == 0
    assert (
        messages(fresh)[0]
        == "Run created: 3 steps on model agent, starting from the base model (a fresh adapter); learning "
        "rate 0.00022, the grpo default for a base model whose width this host cannot read"
    )
    services.run_cancel(run=fresh)
    for step in (0, 4):
        services.checkpoint_record(model=alpha_setup.model, run=None, step=step, path=f"/ckpt/{step}")
    run = create(alpha_setup)
    assert (run.start_step, run.current_step) == (4, 4)
    first = RunEvent.objects.filter(run=run).first()
    assert first is not None
    assert first.message.startswith("Run created: 3 steps on model agent, starting from checkpoint step 4;")
    latest = Checkpoint.objects.get(model=alpha_setup.model, step=4)
    assert first.data == {"start_from": "latest", "start_step": 4, "checkpoint": latest.pk}
    spec = build_run_spec(claimed(run))
    assert (spec.start_step, spec.resume_step) == (4, 4)


def test_base_is_a_fresh_adapter_and_a_409_on_a_model_trained_past_step_0(alpha_setup, enqueued):
    run = create(alpha_setup, start_from="base")
    assert run.start_step == 0 and build_run_spec(claimed(run)).resume_step is None
    services.run_transition(run_id=run.pk, to=RunStatus.CANCELLED, message="done with it")
    services.checkpoint_record(model=alpha_setup.model, run=None, step=0, path="/ckpt/0")
    services.checkpoint_record(model=alpha_setup.model, run=None, step=2, path="/ckpt/2")
    with pytest.raises(Conflict, match="has trained to checkpoint step 2") as caught:
        create(alpha_setup, start_from="base")
    assert (caught.value.field, caught.value.code) == ("start_from", "model_has_checkpoints")


def test_a_checkpoint_id_pins_the_start_to_the_models_latest(alpha_setup, enqueued):
    old = services.checkpoint_record(model=alpha_setup.model, run=None, step=0, path="/ckpt/0")
    latest = services.checkpoint_record(model=alpha_setup.model, run=None, step=5, path="/ckpt/5")
    other_model = factories.TrainableModelFactory(project=alpha_setup.project, base_model=alpha_setup.base)
    elsewhere = services.checkpoint_record(model=other_model, run=None, step=5, path="/ckpt/x")
    with pytest.raises(Conflict, match="whose latest is step 5") as caught:
        create(alpha_setup, start_from=old.pk)
    assert caught.value.field == "start_from" and caught.value.code == "not_latest_checkpoint"
    with pytest.raises(ValidationFailed, match=f"has no checkpoint {elsewhere.pk}") as missing:
        create(alpha_setup, start_from=elsewhere.pk)
    assert missing.value.field == "start_from"
    for bad in ("newest", True, 1.5):
        with pytest.raises(ValidationFailed) as wrong:
            create(alpha_setup, start_from=bad)
        assert wrong.value.field == "start_from"
    assert create(alpha_setup, start_from=latest.pk).start_step == 5


# --- fork ----------------------------------------------------------------------------------------


def checkpoint_folder(root: Path, step: int) -> Path:
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights of step %d" % step)
    (folder / "optimizer.pt").write_bytes(b"moments")
    (folder / "rng_state.pt").write_bytes(b"generators")
    (folder / "state.json").write_text(json.dumps({"format_version": 1, "step": step, "metrics": {}}))
    return folder


def test_a_fork_copies_the_checkpoint_as_its_new_models_step_0_and_queues_a_run(
    alpha_setup, enqueued, settings, tmp_path, django_capture_on_commit_callbacks
):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    run = claimed(create(alpha_setup, created_by=None))
    source_root = settings.CHECKPOINT_DIR / f"model-{alpha_setup.model.pk}"
    for step in (0, 1, 2):
        services.checkpoint_record(
            model=alpha_setup.model, run=run, step=step, path=str(checkpoint_folder(source_root, step))
        )
    with django_capture_on_commit_callbacks(execute=True):
        fork = services.run_fork(run=run, from_step=1, name="agent-lr", config={"learning_rate": 0.5})
    model = TrainableModel.objects.get(name="agent-lr")
    assert fork.model_id == model.pk and fork.project_id == run.project_id and enqueued == [fork.pk]
    assert (model.base_model_id, model.lora) == (alpha_setup.model.base_model_id, alpha_setup.model.lora)
    assert fork.config["learning_rate"] == 0.5
    assert {k: v for k, v in fork.config.items() if k != "learning_rate"} == {
        k: v for k, v in run.config.items() if k != "learning_rate"
    }
    assert (fork.task_set_id, fork.environment_id, fork.reward_id) == (
        run.task_set_id, run.environment_id, run.reward_id,
    )  # fmt: skip
    source = Checkpoint.objects.get(model=alpha_setup.model, step=1)
    assert fork.forked_from_id == source.pk and fork.start_step == 0
    (step_zero,) = Checkpoint.objects.filter(model=model)
    copied = Path(step_zero.path)
    assert step_zero.step == 0 and copied == settings.CHECKPOINT_DIR / f"model-{model.pk}" / "step-000000"
    assert step_zero.storage_key == f"model-{model.pk}/step-000000" and step_zero.sha256, "stored"
    assert (copied / "adapter_model.safetensors").read_bytes() == b"weights of step 1"
    assert (copied / "optimizer.pt").read_bytes() == b"moments"
    state = json.loads((copied / "state.json").read_text())
    assert state["step"] == 0 and state["forked_from"] == {
        "model": alpha_setup.model.pk, "step": 1, "checkpoint": source.pk, "fresh_state": False,
    }  # fmt: skip
    assert sorted(p.name for p in copied.parent.iterdir()) == ["step-000000"], "no scratch left"
    assert messages(fork)[0] == (
        "Run created: 3 steps on model agent-lr, starting from step 0, a copy of agent:1 (forked)"
    )
    assert f"Forked from checkpoint step 1 as model agent-lr (run #{fork.pk})" in messages(run)
    spec = build_run_spec(claimed(fork, "w2"))
    assert spec.resume_step == 0 and spec.checkpoint_root == copied.parent


def test_a_fork_with_bad_input_leaves_no_model_and_no_files(alpha_setup, enqueued, settings, tmp_path):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    run = create(alpha_setup)
    root = settings.CHECKPOINT_DIR / f"model-{alpha_setup.model.pk}"
    services.checkpoint_record(model=alpha_setup.model, run=run, step=0, path=str(checkpoint_folder(root, 0)))
    models_before = TrainableModel.objects.count()
    cases = [
        ({"from_step": 7, "name": "copy"}, "from_step", "has no checkpoint at step 7 (it has steps 0)"),
        ({"from_step": 0, "name": "agent"}, "name", "already exists"),
        ({"from_step": 0, "name": "Not A Slug"}, "name", "lowercase"),
        ({"from_step": 0, "name": "copy", "config": {"learning_rate": -1}}, "config.learning_rate", ""),
        ({"from_step": 0, "name": "copy", "config": {"no_such": 1}}, "config.no_such", ""),
    ]
    for arguments, field, text in cases:
        with pytest.raises(ValidationFailed, match=re.escape(text)) as caught:
            services.run_fork(run=run, **arguments)
        assert caught.value.field == field, arguments
    assert TrainableModel.objects.count() == models_before
    assert sorted(p.name for p in settings.CHECKPOINT_DIR.iterdir()) == [f"model-{alpha_setup.model.pk}"]


def test_a_fork_of_a_checkpoint_whose_files_are_gone_is_a_409(alpha_setup, enqueued, settings, tmp_path):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    run = create(alpha_setup)
    services.checkpoint_record(model=alpha_setup.model, run=run, step=0, path=str(tmp_path / "gone"))
    with pytest.raises(Conflict, match="missing") as caught:
        services.run_fork(run=run, from_step=0, name="copy")
    assert caught.value.field == "from_step"
    assert not TrainableModel.objects.filter(name="copy").exists()


def test_a_fork_of_a_checkpoint_kept_as_adapter_only_gets_fresh_optimizer_and_rng_state(
    alpha_setup, enqueued, settings, tmp_path
):
    import torch
    from safetensors.torch import save_file

    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    run = create(alpha_setup)
    folder = checkpoint_folder(settings.CHECKPOINT_DIR / f"model-{alpha_setup.model.pk}", 0)
    tensors = {f"layer.{i}.lora_{ab}.weight": torch.ones(2, 2) for i in range(2) for ab in "AB"}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    for name in ("optimizer.pt", "rng_state.pt"):  # what retention does to a checkpoint no resume needs
        (folder / name).unlink()
    services.checkpoint_record(model=alpha_setup.model, run=run, step=0, path=str(folder))
    fork = services.run_fork(run=run, from_step=0, name="copy", config={"learning_rate": 0.25, "seed": 7})
    copied = Path(Checkpoint.objects.get(model=fork.model, step=0).path)
    assert json.loads((copied / "state.json").read_text())["forked_from"]["fresh_state"] is True
    parameters = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in tensors]
    optimizer = torch.optim.AdamW(parameters)
    optimizer.load_state_dict(torch.load(copied / "optimizer.pt", weights_only=True))
    assert optimizer.state_dict()["state"] == {} and optimizer.param_groups[0]["lr"] == 0.25
    rng = torch.load(copied / "rng_state.pt", weights_only=True)
    assert torch.equal(rng["torch"], torch.Generator().manual_seed(7).get_state())
    assert not (folder / "optimizer.pt").exists(), "the source is left as it was"
