"""A client's training job as claimed work, in-process on the tiny model: claimed in submit order,
one step from checkpoint N to N+1 recorded like a run's (step metrics, trajectories, checkpoint,
events ending in training_ended), a job whose groups have no variance still advances the step, a
bad group or a choice of another model fails readably, and a lost worker's job is redone."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from django.utils import timezone
from transformers import AutoTokenizer

from projects import services
from projects.errors import ValidationFailed
from projects.jobs import claimed
from projects.jobs.hosts import session_host
from projects.jobs.training_jobs import TRAINING_JOB, accepts_model
from projects.models import (
    Checkpoint,
    Run,
    RunEvent,
    StepMetrics,
    TrainableModel,
    TrainingJob,
    TrainingJobEvent,
    TrainingJobStatus,
    Trajectory,
)
from tests.training.test_client_groups import Sampler, group, trajectory

# Committed rows: the job's heartbeat thread reads them on its own connection.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def enqueued(monkeypatch) -> list[int]:
    """Jobs the services enqueue after commit, kept here instead of sent to a broker."""
    sent: list[int] = []
    monkeypatch.setattr("projects.services.training_jobs._enqueue", sent.append)
    return sent


@pytest.fixture
def world(cast, tiny_model_dir: Path, settings, tmp_path: Path, enqueued):
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    settings.MODEL_CACHE_DIR = tmp_path / "models"
    settings.RUN_HEARTBEAT_TIMEOUT_S = 30
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="agent", base_model="tiny"
    )
    sampler = Sampler(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    return type("World", (), {"model": model, "run": run, "sampler": sampler})


def upload(world, *rewards: float, model_id: str = "math/agent:0") -> list[dict]:
    prompt = [{"role": "user", "content": "Say hi"}]
    trajectories = []
    for index, reward in enumerate(rewards):
        choice = world.sampler.choice(prompt, f"hi {index}")
        choice["artweb_model"] = model_id
        trajectories.append(trajectory([*prompt, choice], reward))
    return [group(*trajectories)]


def submit(world, *rewards: float, **extra) -> TrainingJob:
    return services.training_job_create(
        model=world.model,
        trajectory_groups=upload(world, *rewards, **extra),
        experimental_config={"learning_rate": 1e-3},
    )


def events(job: TrainingJob) -> list[str]:
    return list(TrainingJobEvent.objects.filter(job=job).order_by("id").values_list("type", flat=True))


def test_registration_gives_step_0_without_files_and_a_client_run(world):
    (checkpoint,) = Checkpoint.objects.filter(model=world.model)
    assert (checkpoint.step, checkpoint.path, checkpoint.run_id) == (0, "", world.run.pk)
    assert world.run.status == "running" and world.run.kind == "client"


def test_jobs_train_one_step_each_in_submit_order_recorded_like_a_runs_steps(world, enqueued):
    first, second = submit(world, 1.0, 0.0), submit(world, 0.0, 1.0, model_id="math/agent:1")
    assert services.training_job_claim(job_id=second.pk, worker="w") is None  # first one first
    assert enqueued == [first.pk, second.pk]
    assert claimed.work_on(TRAINING_JOB, first.pk) == "succeeded"
    assert enqueued[-1] == second.pk  # the first one's end enqueues the next
    first.refresh_from_db()
    assert first.status == TrainingJobStatus.SUCCEEDED and first.step == 1 and first.groups == []
    assert events(first) == ["training_started", "gradient_step", "training_ended"]
    gradient = TrainingJobEvent.objects.get(job=first, type="gradient_step").data
    assert {"reward", "reward_std_dev", "loss", "entropy", "kl_div", "grad_norm", "learning_rate",
            "num_groups_submitted", "num_groups_trainable", "num_trajectories", "num_trainable_tokens",
            "time/step_queue_wait_s", "time/step_load_s", "time/step_update_s", "time/step_save_s"} <= gradient.keys()  # fmt: skip
    assert gradient["num_groups_trainable"] == 1.0 and gradient["reward"] == 0.5
    checkpoint = Checkpoint.objects.get(model=world.model, step=1)
    assert Path(checkpoint.path, "adapter_model.safetensors").exists() and checkpoint.run_id == world.run.pk
    assert StepMetrics.objects.get(run=world.run, step=1).reward_mean == 0.5
    stored = list(Trajectory.objects.filter(run=world.run, step=1))
    assert [t.reward for t in stored] == [1.0, 0.0]
    assert stored[0].metrics["token_source"] == "gateway" and stored[0].metrics["advantage"] > 0
    assert stored[0].messages[-1]["role"] == "assistant" and stored[0].completion_tokens > 0
    assert claimed.work_on(TRAINING_JOB, second.pk) == "succeeded"
    second.refresh_from_db()
    assert second.step == 2
    run = Run.objects.get(pk=world.run.pk)
    assert (run.current_step, run.total_steps, run.status) == (2, 2, "running")
    assert RunEvent.objects.filter(run=run, type="metrics").count() == 2
    assert claimed.work_on(TRAINING_JOB, second.pk) == "skipped"  # a duplicate delivery


def test_groups_without_variance_still_advance_the_step(world):
    job = submit(world, 0.5, 0.5)
    assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded"
    gradient = TrainingJobEvent.objects.get(job=job, type="gradient_step").data
    assert gradient["num_groups_trainable"] == 0.0 and gradient["num_trainable_tokens"] == 0.0
    assert Checkpoint.objects.filter(model=world.model, step=1).exists()


def test_a_choice_of_another_model_fails_the_job_readably(world):
    job = submit(world, 1.0, 0.0, model_id="other/model:3")
    assert claimed.work_on(TRAINING_JOB, job.pk) == "failed"
    job.refresh_from_db()
    assert job.status == "failed" and "was sampled from `other/model:3`" in job.error
    failed = TrainingJobEvent.objects.get(job=job, type="training_failed")
    assert failed.data["error_message"] == job.error
    assert not Checkpoint.objects.filter(model=world.model, step=1).exists()
    follow = submit(world, 1.0, 0.0)  # the model trains on: the failure held nothing
    assert claimed.work_on(TRAINING_JOB, follow.pk) == "succeeded"


def test_a_job_whose_worker_died_is_redone_once(world):
    job = submit(world, 1.0, 0.0)
    assert services.training_job_claim(job_id=job.pk, worker="dead") is not None
    assert claimed.work_on(TRAINING_JOB, job.pk) == "skipped"  # the owner still counts as alive
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert services.training_jobs_requeue_orphaned() == [job.pk]
    assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded"
    job.refresh_from_db()
    assert job.attempts == 2 and job.step == 1
    assert events(job) == ["training_started", "gradient_step", "training_ended"]


def test_the_next_job_starts_from_the_session_the_last_one_kept(world, settings):
    settings.RESIDENT_SESSIONS = 1
    sessions = session_host()
    before = (sessions.hits, sessions.misses)

    def counts() -> tuple[int, int]:
        return sessions.hits - before[0], sessions.misses - before[1]

    first = submit(world, 1.0, 0.0)
    assert claimed.work_on(TRAINING_JOB, first.pk) == "succeeded"
    second = submit(world, 0.0, 1.0, model_id="math/agent:1")
    assert claimed.work_on(TRAINING_JOB, second.pk) == "succeeded"
    assert counts() == (1, 1)  # the first loaded; the second took its session
    loads = [StepMetrics.objects.get(run=world.run, step=step).metrics["load_seconds"] for step in (1, 2)]
    assert loads[1] < loads[0] / 5, loads
    # A checkpoint deleted and remade at the same step elsewhere would have another row: a miss.
    services.checkpoint_record(model=world.model, run=world.run, step=3, path="/elsewhere/step-000003")
    third = submit(world, 1.0, 0.0, model_id="math/agent:2")
    claimed.work_on(TRAINING_JOB, third.pk)  # fails (no files at /elsewhere), but never on a kept session
    assert counts() == (1, 2)


def test_the_workers_own_sessions_are_put_on_the_workers_training_device(settings, monkeypatch):
    """Without a trainer service the worker keeps sessions itself: on TRAINING_DEVICE (the pool
    put every session's policy on the CPU before, even on a GPU worker), able to start ranks."""
    from projects.jobs import hosts

    monkeypatch.setattr(hosts, "_resident", None)
    settings.TRAINER_SERVICE_URL = ""
    settings.TRAINING_DEVICE = "cuda:3"  # nothing is opened: only where the pool would train
    pool = session_host().pool
    assert (pool.device, pool.model_cache_dir, pool.unsloth) == (
        "cuda:3",
        settings.MODEL_CACHE_DIR,
        settings.TRAINING_UNSLOTH,
    )


def test_a_models_devices_train_its_jobs_data_parallel_and_a_change_opens_a_new_session(
    world, settings, monkeypatch
):
    from projects.jobs import hosts
    from training.hosting.followers import follower_pids

    monkeypatch.setattr(hosts, "_resident", None)
    settings.TRAINER_SERVICE_URL = ""
    services.trainable_model_update(model=world.model, devices=2)
    sessions = session_host()
    try:
        first = submit(world, 1.0, 0.0)
        assert claimed.work_on(TRAINING_JOB, first.pk) == "succeeded"
        assert StepMetrics.objects.get(run=world.run, step=1).metrics["update_devices"] == 2
        assert list(sessions.pool.stats()["data_parallel"]) == [f"model-{world.model.pk}"]
        assert len(follower_pids()) == 1
        services.trainable_model_update(model=world.model, devices=1)
        second = submit(world, 0.0, 1.0, model_id="math/agent:1")
        assert claimed.work_on(TRAINING_JOB, second.pk) == "succeeded"
        assert StepMetrics.objects.get(run=world.run, step=2).metrics["update_devices"] == 1
        assert sessions.misses == 2 and follower_pids() == []  # the kept session held 2 devices: reopened
    finally:
        for model in sessions.pool.sessions():
            sessions.pool.close(model)


def test_a_job_trains_on_the_devices_stored_when_it_was_queued(world, settings, monkeypatch):
    """A job's config is resolved when it is queued (the model's devices then) and the worker reads
    it as stored (issue 53, must-have 3): a change of the model's devices reaches the jobs queued
    after it, not one already waiting."""
    from projects.jobs import hosts

    monkeypatch.setattr(hosts, "_resident", None)
    settings.TRAINER_SERVICE_URL = ""
    job = submit(world, 1.0, 0.0)
    assert (job.config["devices"], job.config["fsdp"]) == (1, False)
    services.trainable_model_update(model=world.model, devices=2)
    sessions = session_host()
    try:
        assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded"
        assert StepMetrics.objects.get(run=world.run, step=1).metrics["update_devices"] == 1
        assert sessions.pool.stats()["data_parallel"] == {}
    finally:
        for model in sessions.pool.sessions():
            sessions.pool.close(model)


def test_a_choice_may_come_from_any_step_of_the_model_or_its_base():
    model = type("M", (), {"project": type("P", (), {"name": "math"}), "name": "agent",
                           "base_model": type("B", (), {"name": "tiny"})})  # fmt: skip
    accepts = accepts_model(model)  # type: ignore[arg-type]
    assert accepts("math/agent:0") and accepts("math/agent:12") and accepts("tiny")
    assert not accepts("math/agent2:1") and not accepts("math/agent:latest") and not accepts("other/agent:1")


def test_jobs_through_the_trainer_service_train_exactly_as_in_the_worker(world, settings, live_service, cast):
    from safetensors.torch import load_file

    def two_jobs(model_name: str, devices: int = 1) -> dict:
        model = world.model if model_name == "agent" else services.client_model_register(
            team=cast.alpha, entity=None, project="math", name=model_name, base_model="tiny"
        )[0]  # fmt: skip
        services.trainable_model_update(model=model, devices=devices)
        for step, rewards in ((0, (1.0, 0.0)), (1, (0.0, 1.0))):
            job = services.training_job_create(
                model=model, trajectory_groups=upload(world, *rewards, model_id=f"math/{model_name}:{step}"),
                experimental_config={"learning_rate": 1e-3},
            )  # fmt: skip
            assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded", TrainingJob.objects.get(
                pk=job.pk
            ).error
        checkpoint = Checkpoint.objects.get(model=model, step=2)
        return load_file(Path(checkpoint.path) / "adapter_model.safetensors")

    settings.TRAINER_SERVICE_URL = ""
    in_worker = two_jobs("agent")
    settings.TRAINER_SERVICE_URL, settings.TRAINER_SERVICE_TOKEN = live_service.url, "secret-token"
    sessions = session_host()
    through_service = two_jobs("twin")
    assert (sessions.hits, sessions.misses) == (1, 1)  # the second job found its session on the service
    stats = live_service.stats()
    assert stats["sessions"] == 1 and stats["base_loads"] == 1 and stats["primitives_run"] >= 4
    assert stats["held"] == {}  # released between jobs
    assert in_worker.keys() == through_service.keys()
    assert all(torch.equal(in_worker[name], through_service[name]) for name in in_worker)
    load_seconds = (
        StepMetrics.objects.filter(run__model__name="twin")
        .order_by("step")
        .values_list("metrics__load_seconds", flat=True)
    )
    assert len(load_seconds) == 2 and load_seconds[1] < load_seconds[0]  # a claim, not a load
    # A model with devices: 2: its session on the service, rank 1 a follower of the service's.
    data_parallel = two_jobs("triplet", devices=2)
    assert live_service.stats()["data_parallel"] == {
        f"model-{TrainableModel.objects.get(name='triplet').pk}": {"devices": 2, "rank_restarts": 0}
    }
    gap = max(float((in_worker[name] - data_parallel[name]).abs().max()) for name in in_worker)
    assert gap < 3e-5, gap  # gradients summed over 2 ranks: float32 addition order
    assert StepMetrics.objects.get(run__model__name="triplet", step=2).metrics["update_devices"] == 2
    # Another model's data-parallel jobs: the triplet's kept session (released, reopened from its
    # checkpoint when needed) gives its ranks up.
    two_jobs("quad", devices=2)
    quad = TrainableModel.objects.get(name="quad")
    assert list(live_service.stats()["data_parallel"]) == [f"model-{quad.pk}"]
    # A data-parallel session someone holds and cannot reopen (a Tinker client's) keeps them: the
    # job fails saying why.
    from training.config import LoraSpec, TrainConfig

    held = live_service.open("held", holder="someone", base_model=str(world.model.base_model.source),
                             config=TrainConfig(devices=2), lora=LoraSpec(rank=2, alpha=4))  # fmt: skip
    assert list(live_service.stats()["data_parallel"]) == ["held"]
    job = services.training_job_create(model=quad, trajectory_groups=upload(world, 1.0, 0.0, model_id="math/quad:2"),
                                       experimental_config={"learning_rate": 1e-3})  # fmt: skip
    assert claimed.work_on(TRAINING_JOB, job.pk) == "failed"
    assert "already trains a data-parallel session (held)" in TrainingJob.objects.get(pk=job.pk).error
    held.close()


def stored_completion(
    world, cast, completion_id: str, messages: list, text: str, *, reward: float | None,
    served_by: str = "math/agent:0", conversation: str = "",
):  # fmt: skip
    """A completion stored as the gateway stores one: the sampler's exact ids and logprobs for
    ``text`` after ``messages``, with its feedback when ``reward`` is given."""
    from projects.models import StoredCompletion

    choice = world.sampler.choice(messages, text)
    row = services.stored_completion_create(
        team_id=cast.alpha.pk, completion_id=completion_id, api_key_id=None, model="math/agent:prod",
        served_by=served_by, checkpoint_id=None, stream=False,
        metadata={"conversation_id": conversation} if conversation else {}, conversation_id=conversation,
        request={"messages": messages},
        response={"choices": [{"index": 0, "message": choice["message"], "finish_reason": "stop",
                               "logprobs": None}]},
        prompt_token_ids=choice["prompt_token_ids"], token_ids=[choice["token_ids"]],
        logprobs=[[entry["logprob"] for entry in choice["logprobs"]["content"]]], latency_ms=5,
    )  # fmt: skip
    if reward is not None:
        services.feedback_add(team=cast.alpha, value=reward, completion=row)
    return StoredCompletion.objects.get(pk=row.pk)


def test_a_step_on_stored_completions_trains_on_their_exact_tokens_and_records_them(world, cast):
    """What users saw, back to training (projects.services.completion_training.training_job_from_completions):
    stored completions served by the model, with the sampler's ids and logprobs and their feedback,
    become one step's groups (one per prompt), trained as ART's are, the completions named."""

    def stored(
        completion_id: str, prompt: str, text: str, reward: float | None, served_by: str = "math/agent:0"
    ):
        return stored_completion(world, cast, completion_id, [{"role": "user", "content": prompt}], text,
                                 reward=reward, served_by=served_by)  # fmt: skip

    rows = [stored("c-good", "Say hi", "hi", 1.0), stored("c-bad", "Say hi", "go away", 0.0),
            stored("c-alone", "Say bye", "bye", 1.0), stored("c-unrated", "Say hi", "hey", None),
            stored("c-other", "Say hi", "yo", 1.0, served_by="other/agent:2")]  # fmt: skip
    with pytest.raises(ValidationFailed, match="no prompt has two usable completions"):
        services.training_job_from_completions(model=world.model, completions=[rows[0], rows[2]])
    job, counts = services.training_job_from_completions(model=world.model, completions=rows)
    assert counts == {
        "given": 5,
        "unrated": 1,
        "other_model": 1,
        "without_tokens": 0,
        "used": 3,
        "groups": 2,
        "trajectories": 3,
    }
    assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded"
    gradient = TrainingJobEvent.objects.get(job=job, type="gradient_step").data
    assert gradient["num_groups_submitted"] == 2.0 and gradient["num_groups_trainable"] == 1.0
    trained = list(Trajectory.objects.filter(run=world.run, step=1).order_by("reward"))
    assert [t.reward for t in trained] == [0.0, 1.0, 1.0]
    assert {t.metrics["token_source"] for t in trained} == {"gateway"}  # the exact ids, not a re-render
    lineage = RunEvent.objects.filter(run=world.run, data__has_key="stored_completions").get()
    assert lineage.data["stored_completions"] == ["c-good", "c-bad", "c-alone"]
    assert Checkpoint.objects.filter(model=world.model, step=1).exists()


def test_a_conversations_turns_train_as_one_trajectory_on_their_exact_ids(world, cast):
    """A conversation's turns among the completions are one multi-turn trajectory (the reward of
    its newest turn), joined on the sampler's ids: every sampled id of both turns is trained, in
    the context it was sampled in; each trajectory records how stale its sampler was."""
    from training.runs.art_tokens import join_turns

    def stored(completion_id: str, messages: list, text: str, conversation: str, reward: float | None):
        return stored_completion(
            world, cast, completion_id, messages, text, reward=reward, conversation=conversation
        )

    ask = [{"role": "user", "content": "Say hi"}]
    first = stored("c-turn1", ask, "hi", "conv-1", None)
    again = [*ask, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again"}]
    second = stored("c-turn2", again, "hi again", "conv-1", 1.0)  # the conversation's outcome
    alone = stored("c-single", ask, "no", "", 0.0)
    # The first turn is unrated: a conversation's reward is its newest turn's, and both turns train.
    job, counts = services.training_job_from_completions(
        model=world.model, completions=[first, second, alone]
    )
    assert counts["used"] == 3 and counts["trajectories"] == 2 and counts["groups"] == 1
    assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded"
    trained = {t.reward: t for t in Trajectory.objects.filter(run=world.run, step=1)}
    conversation = trained[1.0]
    samples, _ = join_turns(
        [(list(r.prompt_token_ids), r.token_ids[0], r.logprobs[0]) for r in (first, second)]
    )
    assert conversation.metrics["splits"] == len(samples) - 1
    assert conversation.completion_tokens == len(first.token_ids[0]) + len(second.token_ids[0])
    assert conversation.metrics["metadata"]["completion_ids"] == "c-turn1,c-turn2"
    assert conversation.metrics["off_policy_steps"] == 0 and conversation.metrics["policy_step"] == 0
    assert [m.get("content") for m in conversation.messages][-1] == "hi again"
    lineage = RunEvent.objects.filter(run=world.run, data__has_key="served_steps").get()
    assert lineage.data["served_steps"] == {"c-turn1": 0, "c-turn2": 0, "c-single": 0}
