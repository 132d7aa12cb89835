"""Team webhooks: endpoints subscribed to event types, and one delivery row per (event, endpoint).

A delivery is created in the same transaction as what it reports (a run's transition, a recorded
checkpoint) and sent after commit by Celery (projects.jobs.webhooks), retried with backoff; its row
keeps the outcome of every attempt, so the API and the dashboard can show and redeliver it.
"""

from __future__ import annotations

from django.db import models

from projects.models.base import slug_name
from projects.models.teams import Team

# The event types a webhook can subscribe to (a subscription may also be "<prefix>.*" or "*").
WEBHOOK_EVENT_TYPES = (
    "run.succeeded",
    "run.failed",
    "run.cancelled",
    "run.paused",
    "evaluation.succeeded",
    "evaluation.failed",
    "evaluation.cancelled",
    "checkpoint.created",
    "training_job.succeeded",
    "training_job.failed",
    "model_alias.promoted",
    "model_alias.rolled_back",
    "webhook.test",
)


class WebhookEndpoint(models.Model):
    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="webhook_endpoints")
    name = slug_name()
    url = models.URLField(max_length=1000)
    events = models.JSONField(default=list)  # subscriptions: event types, "<prefix>.*" or "*"
    secret_encrypted = models.TextField()  # projects.secrets; the plaintext is shown once
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_webhook_endpoint_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # not tried yet, or waiting for its next attempt
    SUCCEEDED = "succeeded"  # the endpoint answered 2xx
    FAILED = "failed"  # every attempt failed, or the URL is refused by the outbound policy


class WebhookDelivery(models.Model):
    TEAM_PATH = "endpoint__team"
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event_id = models.CharField(max_length=40, db_index=True)  # evt_…: the same on every attempt
    event_type = models.CharField(max_length=40)
    payload = models.JSONField()  # the body sent (without the signature headers)
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    response_status = models.PositiveIntegerField(null=True, blank=True)  # of the last attempt
    error = models.TextField(blank=True, default="")  # of the last attempt
    latency_ms = models.FloatField(null=True, blank=True)  # of the last attempt
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["endpoint", "-id"], name="webhook_delivery_recent")]

    def __str__(self) -> str:
        return f"{self.event_type} {self.event_id} to {self.endpoint_id}"
