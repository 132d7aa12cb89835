"""A training run as claimed work: the run spec built from its rows, and the training loop's view
of the database (``training.runs.loop.RunHooks``) writing through services.

A resumed run (its worker died) is claimed again and continues from its last recorded checkpoint:
the loop never records a step twice (``services.step_record`` is conditional on this worker
owning the run at that step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings

from projects import selectors, services
from projects.grader_secrets import grader_for_build
from projects.jobs.claimed import Claimed, Heartbeat, Job, readable
from projects.jobs.hosts import run_session_host
from projects.models import Checkpoint, Run, RunStatus, Split
from projects.outbound import outbound_policy
from projects.selectors.serving import live_servers
from projects.serving_names import secret_suffix
from projects.storage import StoredObject, checkpoint_local_dir, checkpoint_upload
from training.config import LoraSpec, TrainConfig
from training.cost import sampled_tokens
from training.rewards import RewardFailure
from training.rollouts.trajectory import Trajectory
from training.runs.loop import run_training
from training.runs.spec import RunSpec


class DjangoRunHooks:
    """The training loop's view of the database (training.runs.loop.RunHooks)."""

    def __init__(self, run: Run, worker: str, heartbeat: Heartbeat) -> None:
        self.run, self.worker, self.heartbeat = run, worker, heartbeat

    def should_stop(self) -> str | None:
        # "paused" too (services.run_pause): the loop returns it as its outcome, and _finish gives
        # the run up; the same check between steps as a cancellation.
        if self.heartbeat.lost:
            return "lost"
        return selectors.run_stop_reason(run_id=self.run.pk, worker=self.worker)

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        stored = self._upload(step, path)
        services.checkpoint_record(
            model=self.run.model, run=self.run, step=step, path=str(path), metrics=metrics, stored=stored
        )

    def _upload(self, step: int, path: Path) -> StoredObject:
        """Store the folder the trainer just wrote (projects.storage), before any row names it."""
        return checkpoint_upload(model_id=self.run.model_id, step=step, folder=path)

    def record_step(
        self,
        *,
        step: int,
        metrics: dict[str, Any],
        trajectories: list[tuple[int, int, Trajectory]],
        path: Path,
    ) -> bool:
        if self.should_stop() == "lost":  # another worker owns the run: do not upload over its step
            return False
        stored = self._upload(step, path)
        return services.step_record(
            run=self.run,
            worker=self.worker,
            step=step,
            metrics=metrics,
            trajectories=trajectory_records(trajectories),
            checkpoint_path=str(path),
            stored=stored,
        )

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        services.run_event_add(run=self.run, message=message, level=level, data=data)

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        services.run_evaluation_record(run=self.run, step=step, results=results, samples=samples)

    def is_evaluated(self, *, step: int) -> bool:
        return selectors.run_step_evaluated(run=self.run, step=step)


def trajectory_records(trajectories: list[tuple[int, int, Trajectory]]) -> list[services.TrajectoryRecord]:
    """The loop's (group index, task row index, trajectory) triples as rows to store, numbered
    within their group."""
    counters: dict[int, int] = {}
    records = []
    for group_index, row_index, trajectory in trajectories:
        sample_index = counters.get(group_index, 0)
        counters[group_index] = sample_index + 1
        records.append(
            services.TrajectoryRecord(
                group_index=group_index,
                sample_index=sample_index,
                task_row_index=row_index,
                messages=trajectory.messages,
                reward=trajectory.reward,
                sub_rewards=trajectory.sub_rewards,
                errors=trajectory.errors,
                # The environment's verdict (a game's result) is kept with the metrics: the
                # trajectory table has no column of its own for it.
                metrics={**trajectory.metrics, "outcome": trajectory.outcome}
                if trajectory.outcome
                else trajectory.metrics,
                prompt_tokens=len(trajectory.prompt_token_ids),
                completion_tokens=sampled_tokens(trajectory),
                finish_reason=trajectory.finish_reason,
            )
        )
    return records


def build_run_spec(run: Run) -> RunSpec:
    """Everything the training loop needs for ``run``, read once at its start. The step it starts
    from was fixed at creation (``services.run_create``, ``start_from``); a first attempt, a resumed
    pause and a crash-resume alike continue from the checkpoint of the last recorded step."""
    model = run.model
    resume = selectors.checkpoint_exists(model=model, step=run.current_step)
    # The config as stored, resolved when the run was created (services.run_config_check); a row
    # stored before creation resolved it (no learning rate) goes through the same resolution now.
    config = TrainConfig.from_dict(run.config)
    if config.learning_rate is None:
        config = services.run_config_check(config=run.config, kind=run.kind, model=model)
    if resume:  # its files, fetched into this host's CHECKPOINT_DIR (where the loop reads them)
        checkpoint_local_dir(model.checkpoints.get(step=run.current_step))
        # Rollouts that overlap training sample up to that many checkpoints before it again.
        window = range(max(run.start_step, run.current_step - config.max_off_policy_steps), run.current_step)
        for checkpoint in model.checkpoints.filter(step__in=list(window)).exclude(path=""):
            checkpoint_local_dir(checkpoint)
    task_set, environment, reward = services.run_platform_inputs(run=run)
    return RunSpec(
        base_model_source=model.base_model.source,
        model_cache_dir=settings.MODEL_CACHE_DIR,
        checkpoint_root=services.model_checkpoint_root(model),
        config=config,
        lora=LoraSpec.from_dict(model.lora),
        environment=services.environment_build(environment=environment),
        grader_spec=grader_for_build(reward.spec),
        train_rows=selectors.task_set_rows(task_set=task_set, split=Split.TRAIN),
        start_step=run.start_step,
        resume_step=run.current_step if resume else None,
        stop=list(environment.sampling.get("stop", [])),
        max_grader_error_fraction=settings.GRADER_MAX_ERROR_FRACTION,
        device=settings.TRAINING_DEVICE,
        engine=settings.TRAINING_ENGINE,
        unsloth=settings.TRAINING_UNSLOTH,
        reward_name=f"{reward.name!r} v{reward.version}",
        judge=services.judge_client(team=run.project.team),
        sandbox=services.sandbox_config(team_id=run.project.team_id),
        outbound=outbound_policy(),
        validation_rows=selectors.task_set_rows(task_set=task_set, split=Split.VALIDATION),
        objective=run.kind if run.kind in ("sft", "dpo") else "grpo",
        host=run_session_host(),
        session_id=f"run-{run.pk}",
        rollout_server=run_rollout_server(run, config),
    )


def run_rollout_server(run: Run, config: TrainConfig) -> Any:
    """With ``rollouts_on: inference_servers``: a live inference server of the run's base model
    (training.engines.remote_engine.RolloutServer; the gateway's choice for the run, so every
    attempt of a run goes to the same one while it lives), naming each checkpoint by its store key
    once recorded. None otherwise. No live server: the run cannot start, and says what to do."""
    if config.rollouts_on != "inference_servers":
        return None
    from training.engines.remote_engine import RolloutServer

    base = run.model.base_model
    servers = live_servers(base_model=base, affinity=f"run-{run.pk}")
    if not servers:
        raise ValueError(
            f"rollouts_on: inference_servers, but no inference server of {base.name} is live: start one "
            f"(manage.py serve_inference --base-model {base.name}) or set rollouts_on: worker"
        )
    model_id = run.model_id

    def locate(folder: Path) -> tuple[str, str] | None:
        row = (
            Checkpoint.objects.filter(model_id=model_id, path=str(folder))
            .exclude(storage_key="")
            .values_list("storage_key", "sha256")
            .first()
        )
        return (row[0], row[1]) if row is not None and row[1] else None

    server = servers[0]
    return RolloutServer(
        url=server.url, token=settings.INFERENCE_SERVER_TOKEN, locate=locate,
        # A vLLM server: its dialect, its host's checkpoint fetcher, and adapter names of this run's own
        # that no one else can guess (projects.serving_names).
        engine="vllm" if server.engine == "vllm" else "transformers", fetch_url=server.fetch_url,
        served_model=base.name, adapter_prefix=f"run-{run.pk}-{secret_suffix(f'run-{run.pk}')}-",
    )  # fmt: skip


def _claim(run_id: int, worker: str) -> Run | None:
    return services.run_claim(run_id=run_id, worker=worker)


def _beat(run_id: int, worker: str) -> bool:
    return services.run_heartbeat(run_id=run_id, worker=worker)


def _train(claimed: Claimed[Run]) -> str:
    if claimed.row.current_step > claimed.row.start_step:  # taken over: finish the last worker's step
        services.run_checkpoints_settle(run=claimed.row)
    spec = build_run_spec(claimed.row)
    return run_training(spec, DjangoRunHooks(claimed.row, claimed.worker, claimed.heartbeat))


def _fail(run_id: int, worker: str, exc: BaseException) -> None:
    # A reward failure's message is already the user's sentence; anything else gets its place.
    services.run_fail(run_id=run_id, error=str(exc) if isinstance(exc, RewardFailure) else readable(exc))


def _finish(run: Run, outcome: str) -> None:
    if outcome == "succeeded":
        services.run_transition(run_id=run.pk, to=RunStatus.SUCCEEDED, message="Run succeeded")
    elif outcome == "cancelled":
        services.run_transition(run_id=run.pk, to=RunStatus.CANCELLED, message="Run cancelled")
    elif outcome == "paused":  # the loop stopped at a step boundary: give the run up
        services.run_pause_finish(run_id=run.pk, worker=run.worker)


TRAINING: Job[Run] = Job(
    kind="run",
    claim=_claim,
    beat=_beat,
    work=_train,
    fail=_fail,
    finish=_finish,
    expected_errors=(RewardFailure,),
)
