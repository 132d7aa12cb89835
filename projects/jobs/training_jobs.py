"""A client's training job (``/v1/preview/training-jobs``) as claimed work: the step spec built from
its rows, one call of training.runs.art_step, the step recorded through services.

A job whose worker dies is claimed again and redone from the model's latest recorded checkpoint:
the step it was making was never recorded (``services.training_job_finish`` records it together
with the job's end), so it is made once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings

from projects import selectors, services
from projects.client_names import client_slug
from projects.jobs.claimed import Claimed, Job, readable
from projects.jobs.hosts import session_host
from projects.models import Checkpoint, TrainableModel, TrainingJob
from projects.storage import checkpoint_local_dir, checkpoint_upload
from training.config import ConfigError, LoraSpec, TrainConfig
from training.hosting.resident import SessionKey
from training.recipes.art_config import ArtOptions
from training.runs.art_groups import GroupError, parse_groups
from training.runs.art_step import ClientStepSpec, ScoredTrajectory, off_policy_steps, train_client_step


def accepts_model(model: TrainableModel) -> Callable[[str], bool]:
    """Which ``artweb_model`` a choice may carry to train ``model``: any of its checkpoints (ART
    trains off-policy on earlier steps' samples too), named by their slugs or by the names the
    client sampled them under (projects.client_names), or its base model."""
    base = model.base_model.name

    def accepts(name: str) -> bool:
        if name == base:
            return True
        pair, _, step = name.rpartition(":")
        project, _, model_name = pair.partition("/")
        return (
            step.isdigit()
            and (client_slug(project), client_slug(model_name))
            == (
                model.project.name,
                model.name,
            )
            if project and model_name
            else False
        )

    return accepts


def session_key(model: TrainableModel, checkpoint: Checkpoint | None, config: TrainConfig) -> SessionKey:
    """The checkpoint a kept session must hold to start a job of ``model`` (its latest), on the
    devices the job's stored ``config`` names."""
    return SessionKey(
        model=f"model-{model.pk}",
        step=checkpoint.step if checkpoint else 0,
        # The row too: a step 0 without files has no digest, and rows are never reused.
        digest=f"{checkpoint.pk}:{checkpoint.sha256 or checkpoint.path}" if checkpoint else "",
        base_model_source=model.base_model.source,
        devices=config.devices,
        fsdp=config.fsdp,
    )


def build_step_spec(job: TrainingJob, latest: Checkpoint | None) -> ClientStepSpec:
    """The job's step from ``latest``, the model's latest checkpoint (None: none yet)."""
    model = job.model
    config = dict(job.config)
    options = ArtOptions.from_dict(config.pop(services.ART_OPTIONS, {}))
    from_step = latest.step if latest else 0
    reference_step = options.reference_step(from_step)
    reference_dir = None
    if reference_step:
        reference = selectors.checkpoint_at(model=model, step=reference_step)
        if reference is None:
            raise ConfigError(
                "kl_penalty_reference_step",
                f"the model has no checkpoint at step {reference_step} (deleted, or not made yet) "
                "to compare with",
            )
        reference_dir = checkpoint_local_dir(reference)
    return ClientStepSpec(
        base_model_source=model.base_model.source,
        model_cache_dir=settings.MODEL_CACHE_DIR,
        checkpoint_root=settings.CHECKPOINT_DIR / f"model-{model.pk}",
        # As stored when the job was created (services.training_job_create: data-parallel on the
        # model's devices then; training.hosting.pool starts the ranks).
        config=TrainConfig.from_dict(config),
        lora=LoraSpec.from_dict(model.lora),
        groups=parse_groups(job.groups, allow_without_logprobs=options.allow_training_without_logprobs),
        from_step=from_step,
        resume_from=checkpoint_local_dir(latest) if latest is not None else None,
        accepts_model=accepts_model(model),
        options=options,
        reference_dir=reference_dir,
        device=settings.TRAINING_DEVICE,
        unsloth=settings.TRAINING_UNSLOTH,
    )


def trajectory_records(scored: list[ScoredTrajectory], *, from_step: int) -> list[services.TrajectoryRecord]:
    """What the trajectory viewer shows of each: the main conversation, the reward, how its
    tokens were found (``token_source``: see training.runs.art_groups) with its advantage, and the
    checkpoint that sampled it with how far behind ``from_step`` (the one updated) that was."""
    counters: dict[int, int] = {}
    records = []
    for item in scored:
        sample_index = counters.get(item.group_index, 0)
        counters[item.group_index] = sample_index + 1
        trajectory, tokenized = item.trajectory, item.tokenized
        choices = [c for h in trajectory.histories for c in h.items if not isinstance(c, dict)]
        records.append(
            services.TrajectoryRecord(
                group_index=item.group_index,
                sample_index=sample_index,
                task_row_index=None,
                messages=trajectory.messages(),
                reward=trajectory.reward,
                sub_rewards={},
                errors=[],
                metrics={
                    **trajectory.metrics,
                    "advantage": item.advantage,
                    "token_source": tokenized.token_source,
                    "exact_tokens": tokenized.token_source == "gateway",
                    "prompt_mismatches": tokenized.prompt_mismatches,
                    "splits": tokenized.splits,
                    **(
                        {
                            "policy_step": tokenized.policy_step,
                            "off_policy_steps": off_policy_steps(item, from_step),
                        }
                        if tokenized.policy_step is not None
                        else {}
                    ),  # fmt: skip
                    **({"metadata": trajectory.metadata} if trajectory.metadata else {}),
                    **({"logs": trajectory.logs} if trajectory.logs else {}),
                },
                prompt_tokens=tokenized.prompt_tokens,
                completion_tokens=tokenized.trainable_tokens,
                finish_reason=(choices[-1].finish_reason if choices else "")[:16],
            )
        )
    return records


class _Hooks:
    def __init__(self, job: TrainingJob) -> None:
        self.job = job

    def started(self, *, num_sequences: int) -> None:
        services.training_job_started(job=self.job, num_sequences=num_sequences)


def _claim(job_id: int, worker: str) -> TrainingJob | None:
    return services.training_job_claim(job_id=job_id, worker=worker)


def _beat(job_id: int, worker: str) -> bool:
    return services.training_job_heartbeat(job_id=job_id, worker=worker)


def _train(claimed: Claimed[TrainingJob]) -> str:
    job = claimed.row
    latest = selectors.checkpoint_latest(model=job.model)
    spec = build_step_spec(job, latest)
    sessions = session_host()
    key = session_key(job.model, latest, spec.config)
    kept = None
    try:
        sessions.attach(spec, key)
        result = train_client_step(spec, _Hooks(job))
        outcome = _record(claimed, result)
        if outcome == "succeeded":  # the session holds exactly the step just recorded
            kept = session_key(
                job.model, selectors.checkpoint_at(model=job.model, step=result.step), spec.config
            )
        return outcome
    finally:
        sessions.settle(key.model, kept)


def _record(claimed: Claimed[TrainingJob], result: Any) -> str:
    job = claimed.row
    assert job.started_at is not None
    metrics = {**result.metrics, "queue_seconds": (job.started_at - job.created_at).total_seconds()}
    if claimed.heartbeat.lost:
        return "lost"
    # Stored before the row that names it is written (the row exists only once its files do).
    stored = checkpoint_upload(model_id=job.model_id, step=result.step, folder=Path(result.path))
    recorded = services.training_job_finish(
        job=job,
        worker=claimed.worker,
        step=result.step,
        checkpoint_path=str(result.path),
        stored=stored,
        metrics=metrics,
        events=[
            *result.events[:-1],
            {**result.events[-1], "time/step_queue_wait_s": metrics["queue_seconds"]},
        ],
        trajectories=trajectory_records(result.trajectories, from_step=result.step - 1),
    )
    return "succeeded" if recorded else "lost"


def _fail(job_id: int, worker: str, exc: BaseException) -> None:
    # The client's own mistakes (a malformed group, a choice of another model) are its sentence.
    expected = isinstance(exc, GroupError | ConfigError)
    services.training_job_fail(job_id=job_id, worker=worker, error=str(exc) if expected else readable(exc))


TRAINING_JOB: Job[TrainingJob] = Job(
    kind="training-job",
    claim=_claim,
    beat=_beat,
    work=_train,
    fail=_fail,
    expected_errors=(GroupError, ConfigError),
)
