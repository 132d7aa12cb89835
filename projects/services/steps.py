"""Steps of a run: its metrics, trajectories and checkpoint, recorded together.

Invariant: a step (metrics, trajectories, checkpoint row) is recorded in one transaction after the
checkpoint files are complete; the (run, step) unique constraint makes a replay a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from projects import metrics as step_metrics
from projects.formatting import format_number
from projects.models import Checkpoint, EventType, Run, RunStatus, StepMetrics, TrainableModel, Trajectory
from projects.services import webhooks
from projects.services._common import jsonb_safe
from projects.services.checkpoints import retention_after_step
from projects.services.runs import run_event_add
from projects.storage import StoredObject
from training.runs.progress import step_label


def checkpoint_record(
    *,
    model: TrainableModel,
    run: Run | None,
    step: int,
    path: str,
    metrics: dict[str, Any] | None = None,
    stored: StoredObject | None = None,
) -> Checkpoint:
    """Record a checkpoint whose files are already complete on disk and, given ``stored``, in the
    checkpoint store (projects.storage; idempotent per step)."""
    where = (
        {"storage_key": stored.key, "sha256": stored.sha256, "size_bytes": stored.size_bytes}
        if stored
        else {}
    )
    checkpoint, created = Checkpoint.objects.get_or_create(
        model=model, step=step, defaults={"run": run, "path": path, "metrics": metrics or {}, **where}
    )
    if created:
        webhooks.announce_checkpoint(checkpoint)
    return checkpoint


@dataclass
class TrajectoryRecord:
    group_index: int
    sample_index: int
    task_row_index: int | None
    messages: list[dict[str, Any]]
    reward: float
    sub_rewards: dict[str, float]
    errors: list[dict[str, Any]]
    metrics: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def step_record(
    *,
    run: Run,
    worker: str,
    step: int,
    metrics: dict[str, Any],
    trajectories: list[TrajectoryRecord],
    checkpoint_path: str,
    stored: StoredObject | None = None,
) -> bool:
    """Record one finished step in one transaction. Returns False (and writes nothing) if the step
    is already recorded or this worker lost the run: a step is never counted twice."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status != RunStatus.RUNNING or locked.worker != worker:
            return False
        if StepMetrics.objects.filter(run=locked, step=step).exists():
            return False
        step_rows_write(
            run=locked,
            step=step,
            metrics=metrics,
            trajectories=trajectories,
            path=checkpoint_path,
            stored=stored,
        )
        locked.current_step = step
        locked.heartbeat_at = timezone.now()
        locked.save(update_fields=["current_step", "heartbeat_at"])
        run_event_add(
            run=locked,
            message=_step_message(
                step_label(
                    step, start_step=locked.start_step, final_step=locked.start_step + locked.total_steps
                ),
                metrics,
            ),
            type=EventType.METRICS,
            data={"step": step, **metrics},
        )
    return True


def step_rows_write(
    *,
    run: Run,
    step: int,
    metrics: dict[str, Any],
    trajectories: list[TrajectoryRecord],
    path: str,
    stored: StoredObject | None = None,
) -> None:
    """A step's rows, for a platform run and a client training job alike: its metrics, every
    trajectory and its checkpoint. The caller holds the run's lock inside its transaction."""
    StepMetrics.objects.create(
        run=run,
        step=step,
        reward_mean=metrics.get("reward_mean"),
        reward_std=metrics.get("reward_std"),
        loss=metrics.get("loss"),
        metrics=metrics,
    )
    Trajectory.objects.bulk_create(
        [Trajectory(run=run, step=step, **jsonb_safe(record.__dict__)) for record in trajectories],
        batch_size=200,
    )
    checkpoint_record(model=run.model, run=run, step=step, path=path, metrics=metrics, stored=stored)
    # Counted once the step is committed (a rolled-back step is not a step; projects.metrics).
    transaction.on_commit(lambda: step_metrics.observe_step(kind=run.kind, metrics=metrics))
    # Older state no resume needs and the model's retention policy (services.checkpoints).
    retention_after_step(run=run, step=step)


def _step_message(label: str, metrics: dict[str, Any]) -> str:
    """A step's event line, e.g. "Step 3/20: reward 0.625, loss 1.3e-6" (numbers by magnitude; the
    step named as the worker's phase events name it, ``step_label``); a step without an update
    (every group had one reward) says so instead of its placeholder loss 0."""
    if "reward_mean" not in metrics:  # an SFT or DPO step: targets, no rollouts to reward
        held = metrics.get("heldout_loss")
        return f"{label}: loss {format_number(metrics.get('loss'))}" + (
            f", held-out loss {format_number(held)}" if held is not None else ""
        )
    reward = format_number(metrics.get("reward_mean"))
    if metrics.get("trainable_tokens") == 0:
        return f"{label}: reward {reward}, no update (every group had the same reward)"
    return f"{label}: reward {reward}, loss {format_number(metrics.get('loss'))}"
