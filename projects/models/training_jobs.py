"""Client-driven training (OpenPipe ART's ServerlessBackend protocol, ``/v1/preview/``): a training
job is one step on the scored trajectory groups a client uploaded; its events are what the client
polls; logged groups are kept as they came."""

from __future__ import annotations

from django.db import models

from projects.models.base import ClaimedWork, Event
from projects.models.catalogue import TrainableModel
from projects.models.runs import Run


class TrainingJobStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class TrainingJob(ClaimedWork):
    """One step of a model's client run: checkpoint N in, the groups' update, checkpoint N+1 out.

    Jobs of one model run in the order they were submitted (the claim refuses a job while an
    earlier one is unfinished), and never while a platform run trains the model.
    """

    TEAM_PATH = "model__project__team"
    model = models.ForeignKey(TrainableModel, on_delete=models.CASCADE, related_name="training_jobs")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="training_jobs")
    status = models.CharField(
        max_length=16, choices=TrainingJobStatus.choices, default=TrainingJobStatus.QUEUED
    )
    groups = models.JSONField(default=list, help_text="the uploaded trajectory groups; emptied once recorded")
    config = models.JSONField(default=dict, help_text="TrainConfig as a dict, from experimental_config")
    step = models.PositiveIntegerField(null=True, blank=True, help_text="the checkpoint step it saved")
    metrics = models.JSONField(default=dict, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text="how many times a worker claimed it")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    # A schedule of steps over stored completions (projects.services.completion_training) is its
    # jobs, named by the first one: every step's job points at it, the first at itself.
    schedule = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="schedule_jobs",
        help_text="the first job of the training schedule it is a step of (the schedule's id); null alone",
    )

    class Meta(ClaimedWork.Meta):
        indexes = [
            models.Index(fields=["status", "heartbeat_at"]),
            models.Index(fields=["model", "status"]),
        ]

    def __str__(self) -> str:
        return f"training job {self.pk} ({self.status})"


class TrainingJobEventType(models.TextChoices):
    """ART's event types (art/serverless/client.py TrainingJobEvent)."""

    TRAINING_STARTED = "training_started"
    GRADIENT_STEP = "gradient_step"
    TRAINING_ENDED = "training_ended"
    TRAINING_FAILED = "training_failed"


class TrainingJobEvent(Event):
    """Insert-only history of a training job, oldest first: what the client polls."""

    TEAM_PATH = "job__model__project__team"
    job = models.ForeignKey(TrainingJob, on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=32, choices=TrainingJobEventType.choices)


class ClientLog(models.Model):
    """Trajectory groups a client logged (``POST /v1/preview/models/{id}/log``), kept as sent."""

    TEAM_PATH = "model__project__team"
    model = models.ForeignKey(TrainableModel, on_delete=models.CASCADE, related_name="client_logs")
    split = models.CharField(max_length=32)
    step = models.PositiveIntegerField(help_text="the model's latest step when it was logged")
    groups = models.JSONField(default=list)
    trajectory_count = models.PositiveIntegerField(default=0)
    reward_mean = models.FloatField(null=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.model} {self.split} log at step {self.step}"
