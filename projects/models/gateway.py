"""What the gateway keeps: the inference servers it routes to and the tokens each key used."""

from __future__ import annotations

from django.db import models

from projects.models.catalogue import BaseModel
from projects.models.runs import Checkpoint
from projects.models.teams import ApiKey, Team


class InferenceServer(models.Model):
    """A running inference server (``manage.py serve_inference``) for one base model.

    The server writes its row when it starts and ``heartbeat_at`` every few seconds; the gateway
    routes only to rows with a fresh heartbeat, so a server that dies stops receiving traffic
    within ``INFERENCE_HEARTBEAT_TIMEOUT_S`` without anyone cleaning up. Operator-level: no team.
    """

    base_model = models.ForeignKey(BaseModel, on_delete=models.CASCADE, related_name="inference_servers")
    url = models.CharField(max_length=300, unique=True, help_text="base URL, e.g. http://10.0.0.5:8100")
    engine = models.CharField(max_length=32, default="transformers")
    capacity = models.PositiveIntegerField(default=8, help_text="LoRA adapters it keeps loaded at once")
    max_batch_size = models.PositiveIntegerField(default=32)
    loaded_adapters = models.JSONField(default=list, blank=True)
    fetch_url = models.CharField(
        max_length=300, blank=True, default="",
        help_text="a vLLM server's checkpoint fetcher (training.serving.fetch_server); empty: none",
    )  # fmt: skip
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["base_model", "heartbeat_at"])]
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.url} ({self.base_model.name})"


class UsageRecord(models.Model):
    """Tokens used through the gateway: one row per API key, model id and UTC day, incremented
    in place. ``model`` is the resolved id (``project/model:step`` or a base model name), kept as
    text so usage stays readable after a checkpoint or key is deleted."""

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    model = models.CharField(max_length=300)
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage_records"
    )
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["api_key", "model", "day"], name="unique_usage_per_key_model_day")
        ]
        indexes = [models.Index(fields=["team", "day"])]
        ordering = ["day", "model"]

    def __str__(self) -> str:
        return f"{self.team} {self.model} {self.day}"
