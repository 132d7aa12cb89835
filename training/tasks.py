"""Celery tasks: thin wrappers that load rows, call the training core, write through services.

``train_run`` is delivered at least once. Its first act is ``run_claim`` (idempotent): a duplicate
delivery, a finished run or a run owned by a live worker is a no-op. A worker that dies is
detected by its stale heartbeat; ``requeue_orphaned_runs`` (celery beat) re-enqueues the run and
the next claim resumes it from its last recorded checkpoint. ``evaluate`` works the same way with
one ``_Heartbeat`` of its own, except that a taken-over evaluation restarts from scratch
(``requeue_orphaned_evaluations``, ``projects.evaluations.evaluation_claim``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import close_old_connections, connection

from projects import evaluations, judges, services
from projects.models import Checkpoint, Evaluation, Run, RunStatus, Split, TaskRow
from training.loop import RewardFailure, RunSpec, run_training, sampled_tokens
from training.rollout import Trajectory

logger = logging.getLogger(__name__)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _Heartbeat(threading.Thread):
    """Beats while long work runs (a training step, an evaluation's rollouts) in the task's thread.

    ``beat`` refreshes the owner's heartbeat row (``services.run_heartbeat``,
    ``evaluations.evaluation_heartbeat``) and returns False once this worker no longer owns it
    (taken over, or an evaluation cancelled): ``lost`` then tells the work to stop. Use it as a
    context manager: it beats every ``interval`` seconds from entry to exit.
    """

    def __init__(self, beat: Callable[[], bool], *, name: str, interval: float) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{name}")
        self.beat, self.interval = beat, interval
        self.stopped = threading.Event()
        self.lost = False

    @classmethod
    def every_quarter_timeout(cls, beat: Callable[[], bool], *, name: str) -> _Heartbeat:
        """Four beats per ``RUN_HEARTBEAT_TIMEOUT_S``: one slow beat does not make the owner stale."""
        return cls(beat, name=name, interval=max(0.2, settings.RUN_HEARTBEAT_TIMEOUT_S / 4))

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.interval):
                try:
                    if not self.beat():
                        self.lost = True
                except Exception:  # a DB blip must not kill the work; the next beat retries
                    logger.exception("heartbeat %s failed", self.name)
        finally:
            connection.close()

    def __enter__(self) -> _Heartbeat:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self.join(timeout=5)


class DjangoRunHooks:
    """The training loop's view of the database (training.loop.RunHooks)."""

    def __init__(self, run: Run, worker: str, heartbeat: _Heartbeat) -> None:
        self.run, self.worker, self.heartbeat = run, worker, heartbeat

    def should_stop(self) -> str | None:
        if self.heartbeat.lost:
            return "lost"
        state = Run.objects.filter(pk=self.run.pk).values("cancel_requested", "status", "worker").first()
        if state is None or state["status"] != RunStatus.RUNNING or state["worker"] != self.worker:
            return "lost"
        return "cancelled" if state["cancel_requested"] else None

    def record_checkpoint(self, *, step: int, path: Path, metrics: dict[str, Any]) -> None:
        services.checkpoint_record(
            model=self.run.model, run=self.run, step=step, path=str(path), metrics=metrics
        )

    def record_step(
        self,
        *,
        step: int,
        metrics: dict[str, Any],
        trajectories: list[tuple[int, int, Trajectory]],
        path: Path,
    ) -> bool:
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
        return services.step_record(
            run=self.run,
            worker=self.worker,
            step=step,
            metrics=metrics,
            trajectories=records,
            checkpoint_path=str(path),
        )

    def event(self, message: str, *, level: str = "info", data: dict[str, Any] | None = None) -> None:
        services.run_event_add(run=self.run, message=message, level=level, data=data)

    def record_evaluation(self, *, step: int, results: dict[str, Any], samples: list[Any]) -> None:
        evaluations.run_evaluation_record(run=self.run, step=step, results=results, samples=samples)

    def is_evaluated(self, *, step: int) -> bool:
        return evaluations.run_step_evaluated(run=self.run, step=step)


def build_run_spec(run: Run) -> RunSpec:
    from training.config import LoraSpec, TrainConfig

    model = run.model
    if run.attempts == 1:
        latest = Checkpoint.objects.filter(model=model).order_by("-step").first()
        services.run_set_start_step(run=run, start_step=latest.step if latest else 0)
    resume = Checkpoint.objects.filter(model=model, step=run.current_step).exists()
    rows = [
        {"index": row.index, "data": row.data}
        for row in TaskRow.objects.filter(task_set=run.task_set, split=Split.TRAIN).order_by("index")
    ]
    environment = run.environment
    return RunSpec(
        base_model_source=model.base_model.source,
        model_cache_dir=settings.MODEL_CACHE_DIR,
        checkpoint_root=settings.CHECKPOINT_DIR / f"model-{model.pk}",
        config=TrainConfig.from_dict(run.config),
        lora=LoraSpec.from_dict(model.lora),
        environment=evaluations.environment_build(environment=environment),
        grader_spec=run.reward.spec,
        train_rows=rows,
        start_step=run.start_step,
        resume_step=run.current_step if resume else None,
        stop=list(environment.sampling.get("stop", [])),
        max_grader_error_fraction=settings.GRADER_MAX_ERROR_FRACTION,
        device=settings.TRAINING_DEVICE,
        reward_name=f"{run.reward.name!r} v{run.reward.version}",
        judge=judges.judge_client(team=run.project.team),
        sandbox=judges.sandbox_config(),
        validation_rows=[
            {"index": row.index, "data": row.data}
            for row in TaskRow.objects.filter(task_set=run.task_set, split=Split.VALIDATION).order_by("index")
        ],
    )


@shared_task(name="training.train_run", acks_late=True, time_limit=settings.RUN_TIME_LIMIT_S)
def train_run(run_id: int) -> str:
    close_old_connections()
    worker = worker_id()
    run = services.run_claim(run_id=run_id, worker=worker)
    if run is None:
        return "skipped"
    if settings.TORCH_THREADS:
        import torch

        torch.set_num_threads(settings.TORCH_THREADS)
    heartbeat = _Heartbeat.every_quarter_timeout(
        lambda: services.run_heartbeat(run_id=run.pk, worker=worker), name=f"run-{run.pk}"
    )
    try:
        with heartbeat:
            spec = build_run_spec(run)
            outcome = run_training(spec, DjangoRunHooks(run, worker, heartbeat))
    except RewardFailure as exc:
        services.run_fail(run_id=run.pk, error=str(exc))
        return "failed"
    except Exception as exc:
        logger.exception("run %s failed", run.pk)
        services.run_fail(run_id=run.pk, error=_readable(exc))
        return "failed"
    if outcome == "succeeded":
        services.run_transition(run_id=run.pk, to=RunStatus.SUCCEEDED, message="Run succeeded")
    elif outcome == "cancelled":
        services.run_transition(run_id=run.pk, to=RunStatus.CANCELLED, message="Run cancelled")
    return outcome


def _readable(exc: BaseException) -> str:
    """One line a user can act on, plus where it happened (the full traceback is in the worker log)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


@shared_task(name="training.requeue_orphaned_runs", time_limit=60)
def requeue_orphaned_runs() -> list[int]:
    return services.runs_requeue_orphaned()


@shared_task(name="training.requeue_orphaned_evaluations", time_limit=60)
def requeue_orphaned_evaluations() -> list[int]:
    """Evaluation jobs whose worker stopped heartbeating go back on the queue; they restart from scratch."""
    return evaluations.evaluations_requeue_orphaned()


# --- evaluations (POST /api/v1/evaluations) --------------------------------------------------------


@shared_task(
    name="training.evaluate",
    acks_late=True,
    # Past the soft limit the evaluation fails readably; the hard limit is the backstop.
    soft_time_limit=settings.EVALUATION_TIME_LIMIT_S,
    time_limit=settings.EVALUATION_TIME_LIMIT_S + 60,
)
def evaluate(evaluation_id: int) -> str:
    """Evaluate a checkpoint or base model (and a reference) on a task set's rows; results, samples
    and events go through projects.evaluations. Any failure is a failed evaluation with a readable
    error, never a crash of the worker. While it works a heartbeat thread keeps it claimed; if this
    worker dies, another one takes it over and restarts it from scratch (no partial results)."""
    close_old_connections()
    worker = worker_id()
    evaluation = evaluations.evaluation_claim(evaluation_id=evaluation_id, worker=worker)
    if evaluation is None:
        return "skipped"
    if settings.TORCH_THREADS:
        import torch

        torch.set_num_threads(settings.TORCH_THREADS)
    heartbeat = _Heartbeat.every_quarter_timeout(
        lambda: evaluations.evaluation_heartbeat(evaluation_id=evaluation_id, worker=worker),
        name=f"evaluation-{evaluation_id}",
    )
    try:
        with heartbeat:
            return _evaluate(evaluation, worker, heartbeat)
    except Exception as exc:
        logger.exception("evaluation %s failed", evaluation_id)
        evaluations.evaluation_fail(evaluation_id=evaluation_id, error=_readable(exc), worker=worker)
        return "failed"


def _evaluate(evaluation: Evaluation, worker: str, heartbeat: _Heartbeat) -> str:
    import gc

    from training.engines.base import SamplingParams
    from training.evaluation import REFERENCE, with_reference
    from training.evaluation import evaluate as evaluate_policy

    def note(message: str, **data: Any) -> None:
        evaluations.evaluation_event_add(evaluation=evaluation, message=message, data=data)

    def active() -> bool:
        return not heartbeat.lost and evaluations.evaluation_is_active(
            evaluation_id=evaluation.pk, worker=worker
        )

    rows = evaluations.evaluation_rows(evaluation=evaluation)
    if not rows:
        raise ValueError(f"the task set has no {evaluation.split} rows (any more)")
    config = evaluation.config
    sampling = SamplingParams(
        temperature=float(config.get("temperature", 0.0)),
        max_new_tokens=int(config.get("max_new_tokens", 32)),
        stop=list(config.get("stop", [])),
        seed=int(config.get("seed", 0)),
    )
    team = evaluation.project.team
    grading = {"judge": judges.judge_client(team=team), "sandbox": judges.sandbox_config()}
    environment = evaluations.environment_build(environment=evaluation.environment)
    common: dict[str, Any] = {
        "samples_per_row": evaluation.samples_per_row,
        "pass_threshold": evaluation.pass_threshold,
        **grading,
    }
    try:
        subject_label = evaluations.model_label(evaluation.checkpoint, evaluation.base_model)
        if evaluation.checkpoint is None and evaluation.base_model is None:
            raise ValueError("the evaluated checkpoint was deleted")
        policy: Any = _local_policy(evaluation.checkpoint, evaluation.base_model, sampling, subject_label)
        note(f"Loaded {subject_label}; evaluating {len(rows)} rows x {evaluation.samples_per_row} samples")
        result = evaluate_policy(policy, rows, environment, evaluation.reward.spec, **common)
        del policy
        gc.collect()
        note(f"{subject_label}: {evaluations.results_summary(result.results)}", **_flat(result.results))
        if not active():
            return "cancelled"
        reference = _reference_policy(evaluation, sampling)
        if reference is not None:
            note(f"Evaluating the reference {reference.name}")
            reference_result = evaluate_policy(
                reference, rows, environment, evaluation.reward.spec, side=REFERENCE, **common
            )
            note(f"Reference {reference.name}: {evaluations.results_summary(reference_result.results)}")
            result = with_reference(result, reference_result)
    finally:
        close = getattr(environment, "close", None)
        if close is not None:
            close()
    if not evaluations.evaluation_finish(
        evaluation_id=evaluation.pk, worker=worker, results=result.results, samples=result.samples
    ):
        return "cancelled"
    return "succeeded"


def _flat(results: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in results.items() if not isinstance(value, dict)}


def _local_policy(checkpoint: Checkpoint | None, base_model: Any, sampling: Any, name: str) -> Any:
    from training.evaluation import load_local_policy

    source = checkpoint.model.base_model.source if checkpoint is not None else base_model.source
    return load_local_policy(
        base_model_source=source,
        model_cache_dir=settings.MODEL_CACHE_DIR,
        adapter_path=checkpoint.path if checkpoint is not None else None,
        sampling=sampling,
        name=name,
        device=settings.TRAINING_DEVICE,
    )


def _reference_policy(evaluation: Evaluation, sampling: Any) -> Any:
    """The reference side: our checkpoint or base model on this worker, or a model behind a team
    endpoint (its key decrypted here, in the worker, and never logged)."""
    from projects import secrets
    from training.remote import ChatEndpoint, RemotePolicy

    if evaluation.reference_checkpoint is not None or evaluation.reference_base_model is not None:
        label = evaluations.model_label(evaluation.reference_checkpoint, evaluation.reference_base_model)
        return _local_policy(
            evaluation.reference_checkpoint, evaluation.reference_base_model, sampling, label
        )
    endpoint = evaluation.reference_endpoint
    if endpoint is None:
        if evaluation.reference_model:
            raise ValueError("the reference endpoint was deleted")
        return None
    return RemotePolicy(
        endpoint=ChatEndpoint(
            base_url=endpoint.base_url,
            api_key=secrets.decrypt(endpoint.api_key_encrypted),
            timeout=endpoint.timeout_s,
        ),
        model=evaluation.reference_model,
        temperature=sampling.temperature,
        max_tokens=sampling.max_new_tokens,
        seed=sampling.seed,
        name=f"{endpoint.name}:{evaluation.reference_model}",
    )
