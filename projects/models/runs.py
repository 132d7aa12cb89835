"""Runs and what they record: events, step metrics, trajectories and checkpoints."""

from __future__ import annotations

from django.db import models

from projects.models.base import ClaimedWork, Event
from projects.models.catalogue import Environment, Project, RewardDefinition, TaskSet, TrainableModel


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RunKind(models.TextChoices):
    PLATFORM = "platform"  # artweb runs the agent: rollouts, rewards and updates in one job
    CLIENT = "client"  # the client runs its own agent; each step is a training job (OpenPipe ART)
    TINKER = "tinker"  # a Tinker API training client: each optim_step is a step (projects.tinker)
    SFT = "sft"  # supervised fine-tuning on the task rows' assistant replies (training.recipes.supervised)
    DPO = "dpo"  # direct preference optimisation on the rows' chosen / rejected replies


# Run kinds a worker runs as a whole from a task set (claimed, heartbeated, resumed).
WORKER_KINDS = (RunKind.PLATFORM, RunKind.SFT, RunKind.DPO)


# Runs whose steps a client drives (ART's training jobs, Tinker's optim_steps): no worker runs them
# as a whole, so they are never claimed, requeued, cancelled or paused like a platform run.
CLIENT_KINDS = (RunKind.CLIENT, RunKind.TINKER)


class Run(ClaimedWork):
    """A platform run trains on a task set in an environment with a reward; a client run (one per
    model trained through ``/v1/preview/``) has none of these: its steps are the training jobs the
    client submits (projects.models.training_jobs), recorded exactly like a platform run's."""

    TEAM_PATH = "project__team"
    kind = models.CharField(max_length=16, choices=RunKind.choices, default=RunKind.PLATFORM)
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="runs")
    model = models.ForeignKey(TrainableModel, on_delete=models.PROTECT, related_name="runs")
    task_set = models.ForeignKey(
        TaskSet, null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    environment = models.ForeignKey(
        Environment, null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    reward = models.ForeignKey(
        RewardDefinition, null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    config = models.JSONField(help_text="TrainConfig as a dict (all fields, defaults filled in)")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    cancel_requested = models.BooleanField(default=False)
    pause_requested = models.BooleanField(
        default=False, help_text="the worker pauses the run before its next step (services.run_pause)"
    )
    start_step = models.PositiveIntegerField(default=0, help_text="model checkpoint step the run starts from")
    current_step = models.PositiveIntegerField(default=0, help_text="last step recorded")
    total_steps = models.PositiveIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    fine_tuning = models.JSONField(
        default=dict,
        blank=True,
        help_text="a run created as an OpenAI fine-tuning job: what the job was asked (method, files, "
        "suffix, metadata, hyperparameters); {} for every other run (projects.services.fine_tuning)",
    )
    forked_from = models.ForeignKey(
        "Checkpoint",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="forks",
        help_text="the checkpoint this run's model was forked from (its step 0 is a copy of it)",
    )

    class Meta(ClaimedWork.Meta):
        indexes = [models.Index(fields=["status", "heartbeat_at"])]

    def __str__(self) -> str:
        return f"run {self.pk} ({self.status})"

    @property
    def steps_done(self) -> int:
        return max(0, self.current_step - self.start_step) if self.started_at else 0


class EventType(models.TextChoices):
    MESSAGE = "message"
    METRICS = "metrics"


class RunEvent(Event):
    """Insert-only history of a run (OpenAI fine-tuning events shape)."""

    TEAM_PATH = "run__project__team"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    type = models.CharField(max_length=16, choices=EventType.choices, default=EventType.MESSAGE)


class StepMetrics(models.Model):
    TEAM_PATH = "run__project__team"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="step_metrics")
    step = models.PositiveIntegerField()
    reward_mean = models.FloatField(null=True)
    reward_std = models.FloatField(null=True)
    loss = models.FloatField(null=True)
    metrics = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="unique_step_metrics")]
        ordering = ["step"]

    def __str__(self) -> str:
        return f"run {self.run_id} step {self.step}"


class Trajectory(models.Model):
    TEAM_PATH = "run__project__team"
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="trajectories")
    step = models.PositiveIntegerField()
    group_index = models.PositiveIntegerField()
    sample_index = models.PositiveIntegerField()
    task_row_index = models.PositiveIntegerField(null=True)
    messages = models.JSONField()
    reward = models.FloatField()
    sub_rewards = models.JSONField(default=dict)
    errors = models.JSONField(default=list)
    metrics = models.JSONField(default=dict)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    finish_reason = models.CharField(max_length=16, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step", "group_index", "sample_index"], name="unique_trajectory"
            )
        ]
        ordering = ["step", "group_index", "sample_index"]

    def __str__(self) -> str:
        return f"run {self.run_id} step {self.step} group {self.group_index} #{self.sample_index}"


class Checkpoint(models.Model):
    """A saved adapter. The row is written only after its files are complete on disk and stored
    (``projects.storage``: uploaded, for S3); readers get them through ``storage.checkpoint_local_dir``.

    An empty ``path`` is step 0 of a model registered through ``/v1/preview/`` before any training:
    the untrained adapter, whose LoRA B matrices are zero, is exactly the base model, so the
    gateway serves the base model for it and the first training job starts a fresh adapter."""

    TEAM_PATH = "model__project__team"
    model = models.ForeignKey(TrainableModel, on_delete=models.CASCADE, related_name="checkpoints")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="checkpoints")
    step = models.PositiveIntegerField()
    path = models.CharField(max_length=1000)  # the writing host's folder (local storage: the object itself)
    # Where projects.storage holds the files, the digest of their contents and their size; empty
    # for a checkpoint without files and for rows recorded before storage keys (read from `path`).
    storage_key = models.CharField(max_length=500, blank=True, default="")
    sha256 = models.CharField(max_length=64, blank=True, default="")
    size_bytes = models.BigIntegerField(default=0)
    metrics = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "step"], name="unique_checkpoint_step")]
        ordering = ["step"]

    def __str__(self) -> str:
        return f"{self.model} step {self.step}"
