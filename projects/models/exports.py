"""Exports of a checkpoint: its adapter merged into the base model's weights (a Hugging Face
folder: safetensors, config, tokenizer), made by a Celery job and downloadable as an archive.
The adapter alone needs no row: ``GET /api/v1/checkpoints/{id}/adapter`` streams it as it is."""

from __future__ import annotations

from django.db import models

from projects.models.base import ClaimedWork
from projects.models.runs import Checkpoint


class ExportFormat(models.TextChoices):
    MERGED = "merged"  # the adapter merged into the base weights (peft merge_and_unload)


class ExportStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Export(ClaimedWork):
    """One export job of a checkpoint. Its files live in the checkpoint store under ``key`` (below
    the model's folder, so deleting the checkpoint or the model removes them too)."""

    TEAM_PATH = "checkpoint__model__project__team"
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="exports")
    format = models.CharField(max_length=16, choices=ExportFormat.choices, default=ExportFormat.MERGED)
    status = models.CharField(max_length=16, choices=ExportStatus.choices, default=ExportStatus.QUEUED)
    key = models.CharField(max_length=1000, blank=True, default="", help_text="storage key of the folder")
    size_bytes = models.PositiveBigIntegerField(default=0)
    seconds = models.FloatField(null=True, blank=True, help_text="how long the merge took")
    heartbeat_at = models.DateTimeField(null=True, blank=True)

    class Meta(ClaimedWork.Meta):
        indexes = [models.Index(fields=["status", "heartbeat_at"])]

    def __str__(self) -> str:
        return f"export {self.pk} ({self.format}, {self.status})"
