"""Exports of a checkpoint: its adapter merged into the base weights by a Celery job
(``training.export_checkpoint``, projects.jobs.exports), stored as a Hugging Face folder.

Invariants:
- The job is enqueued after the row's transaction commits; its first act is an idempotent claim
  (a conditional UPDATE queued -> running, or of a running export whose worker stopped beating):
  a duplicate delivery is a no-op.
- An export is ``succeeded`` only after its folder is complete in the store (``key`` set then).
- A checkpoint with a queued or running export is in use: retention and deletion leave it (both
  take the model row's lock first, so a delete never misses an export created meanwhile).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from projects.errors import Conflict, NotFound
from projects.models import Checkpoint, Export, ExportFormat, ExportStatus, TrainableModel
from projects.services._common import error_text

EXPORT_MAX_ATTEMPTS = 3


def export_key(export: Export) -> str:
    """Below the model's folder, so the model's size counts it and deleting the model removes it."""
    return f"model-{export.checkpoint.model_id}/exports/export-{export.pk}"


def export_create(
    *, checkpoint: Checkpoint, format: str = ExportFormat.MERGED, created_by: User | None = None
) -> tuple[Export, bool]:
    """Queue an export of ``checkpoint`` (after commit); (export, created). An export of the same
    checkpoint and format that is queued, running or succeeded is returned instead of a new one."""
    if not checkpoint.path and not checkpoint.storage_key:
        raise Conflict(
            f"checkpoint step {checkpoint.step} is the untrained adapter (no files): it is the base "
            "model itself; export a trained step",
            field="checkpoint",
            code="nothing_to_export",
        )
    with transaction.atomic():
        # The lock a checkpoint's deletion takes first (services.checkpoints): an export is created
        # before a delete looks for users of the checkpoint, or after it is gone (404).
        TrainableModel.objects.select_for_update(no_key=True).get(pk=checkpoint.model_id)
        if not Checkpoint.objects.filter(pk=checkpoint.pk).exists():
            raise NotFound("the checkpoint was deleted", field="checkpoint")
        existing = (
            Export.objects.filter(checkpoint=checkpoint, format=format)
            .exclude(status=ExportStatus.FAILED)
            .order_by("-id")
            .first()
        )
        if existing is not None:
            return existing, False
        export = Export.objects.create(checkpoint=checkpoint, format=format, created_by=created_by)
        transaction.on_commit(lambda: _enqueue(export.pk))
    return export, True


def _enqueue(export_id: int) -> None:
    from projects.jobs.queues import base_model_queue
    from projects.jobs.tasks import export_checkpoint

    # The base model's work queue (its GPU class), like its runs: a merge loads the base model.
    export = Export.objects.filter(pk=export_id).select_related("checkpoint__model__base_model").first()
    queue = base_model_queue(export.checkpoint.model.base_model if export is not None else None)
    export_checkpoint.apply_async(args=(export_id,), queue=queue)


def exports_requeue_orphaned(*, stale_after_s: float | None = None) -> list[int]:
    """Re-enqueue running exports whose worker stopped heartbeating and queued ones that waited
    that long (a lost message); the claim decides who works on them (a duplicate is skipped)."""
    stale = settings.RUN_HEARTBEAT_TIMEOUT_S if stale_after_s is None else stale_after_s
    cutoff = timezone.now() - timedelta(seconds=stale)
    orphaned = Export.objects.filter(
        Q(status=ExportStatus.RUNNING, heartbeat_at__lt=cutoff)
        | Q(status=ExportStatus.QUEUED, created_at__lt=cutoff)
    )
    export_ids = sorted(orphaned.values_list("id", flat=True))
    for export_id in export_ids:
        _enqueue(export_id)
    return export_ids


def export_claim(*, export_id: int, worker: str, stale_after_s: float | None = None) -> Export | None:
    """The job's first act: this worker owns the export, or None (nothing changed) for a duplicate
    delivery, a finished export or one a live worker holds. A stale one is taken over (the merge
    restarts from scratch) up to EXPORT_MAX_ATTEMPTS claims, then fails."""
    stale = timezone.now() - timedelta(
        seconds=stale_after_s if stale_after_s is not None else settings.RUN_HEARTBEAT_TIMEOUT_S
    )
    now = timezone.now()
    claimable = Q(status=ExportStatus.QUEUED) | Q(
        Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=stale), status=ExportStatus.RUNNING
    )
    with transaction.atomic():
        export = Export.objects.select_for_update().filter(claimable, pk=export_id).first()
        if export is None:
            return None
        if export.attempts >= EXPORT_MAX_ATTEMPTS:
            export.status, export.finished_at = ExportStatus.FAILED, now
            export.error = f"worker lost {export.attempts} times (last {export.worker or '?'})"
            export.save(update_fields=["status", "finished_at", "error"])
            return None
        export.status, export.worker, export.attempts = ExportStatus.RUNNING, worker, export.attempts + 1
        export.started_at = export.heartbeat_at = now
        export.save(update_fields=["status", "worker", "attempts", "started_at", "heartbeat_at"])
    return export


def export_heartbeat(*, export_id: int, worker: str) -> bool:
    return (
        Export.objects.filter(pk=export_id, worker=worker, status=ExportStatus.RUNNING).update(
            heartbeat_at=timezone.now()
        )
        == 1
    )


def export_finish(*, export_id: int, worker: str, key: str, size_bytes: int, seconds: float) -> bool:
    """Succeeded with its stored folder; False if this worker lost the export meanwhile."""
    updated = Export.objects.filter(pk=export_id, worker=worker, status=ExportStatus.RUNNING).update(
        status=ExportStatus.SUCCEEDED,
        key=key,
        size_bytes=size_bytes,
        seconds=seconds,
        finished_at=timezone.now(),
    )
    return updated == 1


def export_fail(*, export_id: int, worker: str, error: str) -> bool:
    updated = Export.objects.filter(pk=export_id, worker=worker, status=ExportStatus.RUNNING).update(
        status=ExportStatus.FAILED, error=error_text(error), finished_at=timezone.now()
    )
    return updated == 1
