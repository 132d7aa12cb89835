"""Evaluations: a checkpoint or base model on a task set's rows, its graded samples and events."""

from __future__ import annotations

from django.db import models

from projects.models.base import ClaimedWork, Event
from projects.models.catalogue import BaseModel, Environment, Project, RewardDefinition, TaskSet
from projects.models.runs import Checkpoint, Run
from projects.models.teams import JudgeEndpoint


class EvaluationStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Evaluation(ClaimedWork):
    """One checkpoint (or base model) on the rows of a task set, graded by a reward definition,
    optionally against a reference model on the same rows.

    Made by a run (step 0, every ``eval_interval`` steps, the end: ``run`` and ``step`` set) or on
    request (``POST /api/v1/evaluations``: a queued job with its own events). ``results`` holds the
    aggregates: mean reward, pass rate, per-grader means, mean turns, tool-call error rate; with a
    reference, the reference's aggregates and the win rate.
    """

    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="evaluations")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.CASCADE, related_name="evaluations")
    step = models.PositiveIntegerField(null=True, blank=True, help_text="the run's step it evaluates")
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="evaluations"
    )
    base_model = models.ForeignKey(
        BaseModel,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="evaluations",
        help_text="set when a base model (no adapter) is evaluated",
    )
    task_set = models.ForeignKey(TaskSet, on_delete=models.PROTECT, related_name="evaluations")
    split = models.CharField(max_length=16, default="validation", help_text="validation, train or all")
    environment = models.ForeignKey(Environment, on_delete=models.PROTECT, related_name="evaluations")
    reward = models.ForeignKey(RewardDefinition, on_delete=models.PROTECT, related_name="evaluations")
    pass_threshold = models.FloatField(default=1.0, help_text="a sample passes when its reward >= this")
    max_rows = models.PositiveIntegerField(null=True, blank=True)
    samples_per_row = models.PositiveIntegerField(default=1)
    config = models.JSONField(default=dict, blank=True, help_text="sampling settings used")
    reference_checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="reference_evaluations"
    )
    reference_base_model = models.ForeignKey(
        BaseModel, null=True, blank=True, on_delete=models.PROTECT, related_name="reference_evaluations"
    )
    reference_endpoint = models.ForeignKey(
        JudgeEndpoint,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="reference_evaluations",
        help_text="an OpenAI-compatible endpoint the team configured",
    )
    reference_model = models.CharField(max_length=200, blank=True, default="")
    status = models.CharField(
        max_length=16, choices=EvaluationStatus.choices, default=EvaluationStatus.QUEUED
    )
    results = models.JSONField(default=dict, blank=True)
    heartbeat_at = models.DateTimeField(
        null=True, blank=True, help_text="last sign of life of the worker running a queued job"
    )

    class Meta(ClaimedWork.Meta):
        indexes = [models.Index(fields=["status", "heartbeat_at"])]
        constraints = [
            models.UniqueConstraint(
                fields=["run", "step"],
                condition=models.Q(run__isnull=False),
                name="unique_run_step_evaluation",
            )
        ]

    def __str__(self) -> str:
        return f"evaluation {self.pk} ({self.status})"


class EvaluationSample(models.Model):
    """One graded episode of an evaluation: the subject's or the reference's."""

    TEAM_PATH = "evaluation__project__team"
    evaluation = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="samples")
    side = models.CharField(max_length=16, default="subject", help_text="subject or reference")
    task_row_index = models.PositiveIntegerField()
    sample_index = models.PositiveIntegerField(default=0)
    messages = models.JSONField()
    reward = models.FloatField()
    sub_rewards = models.JSONField(default=dict)
    errors = models.JSONField(default=list)
    metrics = models.JSONField(default=dict)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["evaluation", "side", "task_row_index", "sample_index"],
                name="unique_evaluation_sample",
            )
        ]
        ordering = ["side", "task_row_index", "sample_index"]

    def __str__(self) -> str:
        return f"evaluation {self.evaluation_id} {self.side} row {self.task_row_index}"


class EvaluationEvent(Event):
    TEAM_PATH = "evaluation__project__team"
    evaluation = models.ForeignKey(Evaluation, on_delete=models.CASCADE, related_name="events")
