"""A scenario generation job: the dashboard's "Generate scenarios" runs in a Celery worker
(``scenarios.generate``) instead of the web request, and its page polls this row for progress
(rows accepted so far of the rows asked for). It ends with the new task set, or the reason none
was made (with the per-row errors, as the synchronous API reports them)."""

from __future__ import annotations

from django.db import models

from projects.models.base import ClaimedWork
from projects.models.catalogue import Environment, Project, TaskSet
from projects.models.teams import JudgeEndpoint


class ScenarioJobStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class ScenarioJob(ClaimedWork):
    TEAM_PATH = "project__team"
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="scenario_jobs")
    environment = models.ForeignKey(Environment, on_delete=models.CASCADE, related_name="+")
    endpoint = models.ForeignKey(JudgeEndpoint, on_delete=models.SET_NULL, null=True, related_name="+")
    name = models.CharField(max_length=63, help_text="name of the task set it makes")
    instruction = models.TextField()
    model = models.CharField(max_length=200, help_text="the model called at the endpoint")
    validation_fraction = models.FloatField(default=0.0)
    status = models.CharField(
        max_length=16, choices=ScenarioJobStatus.choices, default=ScenarioJobStatus.QUEUED
    )
    rows_done = models.PositiveIntegerField(default=0, help_text="rows accepted so far")
    rows_total = models.PositiveIntegerField(help_text="rows asked for")
    requests_done = models.PositiveIntegerField(default=0)
    task_set = models.ForeignKey(TaskSet, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    problems = models.JSONField(
        default=list, blank=True, help_text="[[where, message]] when no row was valid"
    )

    class Meta(ClaimedWork.Meta):
        pass

    def __str__(self) -> str:
        return f"scenario job {self.pk} ({self.status}, {self.rows_done}/{self.rows_total})"
