"""Reads about checkpoints as stored things: who uses one (so it must stay), the metric a
retention policy ranks by, and the bytes a checkpoint, model or project takes in the store."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db.models import Q

from projects import storage
from projects.models import (
    CLIENT_KINDS,
    Checkpoint,
    Evaluation,
    EvaluationStatus,
    Export,
    ExportStatus,
    ModelAlias,
    Project,
    Run,
    TrainableModel,
)
from projects.storage import CheckpointStore

logger = logging.getLogger(__name__)

ACTIVE_RUN_STATUSES = ("queued", "running", "paused")  # services.runs.ACTIVE_STATUSES
BUSY_EVALUATIONS = (EvaluationStatus.QUEUED, EvaluationStatus.RUNNING)
BUSY_EXPORTS = (ExportStatus.QUEUED, ExportStatus.RUNNING)


def checkpoint_users(*, model: TrainableModel, checkpoints: list[Checkpoint]) -> dict[int, str]:
    """For each of ``checkpoints`` that must not be deleted, by step, who uses it, in words."""
    if not checkpoints:
        return {}
    users: dict[int, str] = {}
    by_id = {c.pk: c for c in checkpoints}
    steps = {c.step for c in checkpoints}
    latest = Checkpoint.objects.filter(model=model).order_by("-step").values_list("step", flat=True).first()
    if latest in steps:
        users[latest] = (
            "it is the model's latest checkpoint (training continues from it and the gateway "
            "serves it as :latest)"
        )
    # A platform run needs the step it started from until it ends (a resume without a recorded
    # step starts there again) and the step it resumes from; a client run's steps all come from
    # the model's latest.
    runs = Run.objects.filter(model=model, status__in=ACTIVE_RUN_STATUSES).exclude(kind__in=CLIENT_KINDS)
    for run in runs.order_by("pk"):
        for step, what in ((run.start_step, "started from"), (run.current_step, "resumes from")):
            if step in steps:
                users.setdefault(step, f"run #{run.pk} ({run.status}) {what} it")
        # Rollouts overlapping training: a resumed run samples the checkpoints just before again.
        lag = int((run.config or {}).get("max_off_policy_steps") or 0)
        for step in range(max(run.start_step, run.current_step - lag), run.current_step):
            if step in steps:
                users.setdefault(step, f"run #{run.pk} ({run.status}) samples it again if it resumes")
    evaluations = Evaluation.objects.filter(status__in=BUSY_EVALUATIONS).filter(
        Q(checkpoint__in=checkpoints) | Q(reference_checkpoint__in=checkpoints)
    )
    for evaluation in evaluations.order_by("pk"):
        for checkpoint_id in (evaluation.checkpoint_id, evaluation.reference_checkpoint_id):
            if checkpoint_id in by_id:
                users.setdefault(
                    by_id[checkpoint_id].step, f"evaluation {evaluation.pk} ({evaluation.status}) reads it"
                )
    for export in Export.objects.filter(status__in=BUSY_EXPORTS, checkpoint__in=checkpoints).order_by("pk"):
        users.setdefault(by_id[export.checkpoint_id].step, f"export {export.pk} ({export.status}) reads it")
    aliases = ModelAlias.objects.filter(Q(checkpoint__in=checkpoints) | Q(candidate__in=checkpoints))
    for alias in aliases.order_by("pk"):
        for checkpoint_id, role in ((alias.checkpoint_id, "serves"), (alias.candidate_id, "canaries")):
            if checkpoint_id in by_id:
                users.setdefault(by_id[checkpoint_id].step, f"alias :{alias.name} {role} it")
    return users


def checkpoint_metric_values(*, checkpoints: list[Checkpoint], metric: str) -> dict[int, float]:
    """``metric`` of each checkpoint that has it, by step: ``eval.<name>`` from the checkpoint's
    newest succeeded evaluation (its subject side), anything else from the step's metrics."""
    values: dict[int, Any] = {}
    if metric.startswith("eval."):
        name = metric.removeprefix("eval.")
        by_id = {c.pk: c for c in checkpoints}
        rows = (
            Evaluation.objects.filter(checkpoint__in=checkpoints, status=EvaluationStatus.SUCCEEDED)
            .order_by("checkpoint_id", "-id")
            .values_list("checkpoint_id", "results")
        )
        for checkpoint_id, results in rows:
            step = by_id[checkpoint_id].step
            if step not in values:  # the newest one
                values[step] = (results or {}).get(name)
    else:
        values = {c.step: (c.metrics or {}).get(metric) for c in checkpoints}
    return {
        step: float(value)
        for step, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


def checkpoint_metric_names(*, model: TrainableModel) -> list[str]:
    """The metrics a retention policy can rank ``model``'s checkpoints by, as
    ``checkpoint_metric_values`` reads them: ``eval.<result>`` of its succeeded evaluations, then
    its step metrics, each sorted; numbers only."""

    def numeric(mapping: Any) -> set[str]:
        items = mapping.items() if isinstance(mapping, dict) else ()
        return {k for k, v in items if isinstance(v, int | float) and not isinstance(v, bool)}

    evaluated: set[str] = set()
    results = Evaluation.objects.filter(checkpoint__model=model, status=EvaluationStatus.SUCCEEDED)
    for row in results.values_list("results", flat=True):
        evaluated |= numeric(row)
    stepped: set[str] = set()
    for row in Checkpoint.objects.filter(model=model).values_list("metrics", flat=True):
        stepped |= numeric(row)
    return [f"eval.{name}" for name in sorted(evaluated)] + sorted(stepped)


def checkpoint_store() -> CheckpointStore:
    """The one checkpoint store (projects.storage): a local folder or an S3-compatible bucket."""
    return storage.checkpoint_store()


def checkpoint_key(checkpoint: Checkpoint) -> str | None:
    """The checkpoint's key in the store, or None for a checkpoint without files (a client model's
    step 0). A row recorded before storage keys has its folder's path relative to CHECKPOINT_DIR;
    a path outside it is never trusted (a row must not make us delete anything else)."""
    if checkpoint.storage_key:
        return str(checkpoint.storage_key)
    if not checkpoint.path:
        return None
    root = Path(settings.CHECKPOINT_DIR).resolve()
    resolved = Path(checkpoint.path).resolve()
    if resolved == root or not resolved.is_relative_to(root):
        logger.warning("not touching checkpoint files outside %s: %s", root, checkpoint.path)
        return None
    return resolved.relative_to(root).as_posix()


model_prefix = storage.model_prefix


def checkpoint_storage_bytes(*, checkpoint: Checkpoint) -> int:
    """The bytes of the checkpoint's folder (as recorded, else as the store counts them)."""
    if checkpoint.size_bytes:
        return int(checkpoint.size_bytes)
    key = checkpoint_key(checkpoint)
    return int(checkpoint_store().size(key)) if key else 0


def model_storage_bytes(*, model: TrainableModel) -> int:
    """Bytes in the store under the model's folder: its checkpoints and exports."""
    return int(checkpoint_store().size(model_prefix(model.pk)))


def project_storage_bytes(*, project: Project) -> int:
    return sum(model_storage_bytes(model=model) for model in project.models.all())
