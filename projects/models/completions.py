"""Stored completions: what the gateway served, kept for review and training (OpenAI's
``store: true``; projects.gateway.capture writes them, projects.api.completions serves them).

A row is one chat completion as the client saw it, with what training needs beside it: the exact
prompt and sampled token ids and the sampler's logprobs (asked of the inference server whether or
not the client asked for them), the checkpoint that served it, the key, the latency. Completions
whose metadata share a value under the team's ``conversation_key`` form one conversation.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

from projects.models.runs import Checkpoint
from projects.models.teams import ApiKey, Team


class StoredCompletion(models.Model):
    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="stored_completions")
    completion_id = models.CharField(max_length=100, unique=True, help_text="the reply's id (chatcmpl-…)")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="stored_completions"
    )
    model = models.CharField(max_length=300, help_text="the model id the request named")
    served_by = models.CharField(
        max_length=300, help_text="the resolved checkpoint (project/model:step) or base"
    )
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="stored_completions"
    )
    stream = models.BooleanField(default=False)
    metadata = models.JSONField(default=dict, blank=True)
    conversation_id = models.CharField(max_length=512, blank=True, default="")
    request = models.JSONField(help_text="the request body less model, metadata and store")
    response = models.JSONField(help_text="the completion as the client saw it, whole (a stream joined)")
    prompt_token_ids = models.JSONField(null=True, blank=True)
    token_ids = models.JSONField(null=True, blank=True, help_text="per choice: the sampled ids")
    logprobs = models.JSONField(null=True, blank=True, help_text="per choice: each sampled token's logprob")
    bounded = models.BooleanField(default=False, help_text="logprobs dropped to keep the row under the bound")
    # The latest feedback's value (CompletionFeedback), on the row so lists filter and sort by it.
    reward = models.FloatField(null=True, blank=True)
    feedback_count = models.PositiveIntegerField(default=0)
    latency_ms = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        indexes = [
            models.Index(fields=["team", "model"]),
            models.Index(fields=["team", "conversation_id"]),
            models.Index(fields=["team", "reward"]),
        ]
        ordering = ["id"]

    def __str__(self) -> str:
        return self.completion_id

    @property
    def sent_messages(self) -> list[dict[str, Any]]:
        """The request's messages as sent (anything not an object left out): the one reader of them."""
        return [m for m in self.request.get("messages") or [] if isinstance(m, dict)]


class CompletionFeedback(models.Model):
    """A reward attached to a stored completion, or to a whole conversation, after the fact: a
    user's thumbs, a downstream outcome, a member's review, a grader run over stored completions.
    The newest one is the completion's ``reward`` (a review overrides what came before); every
    one is kept."""

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="completion_feedback")
    completion = models.ForeignKey(
        StoredCompletion, null=True, blank=True, on_delete=models.CASCADE, related_name="feedback"
    )
    conversation_id = models.CharField(max_length=512, blank=True, default="")
    value = models.FloatField()
    label = models.CharField(max_length=64, blank=True, default="")
    comment = models.TextField(blank=True, default="")
    source = models.CharField(max_length=100, default="api", help_text="api, dashboard, or grader:<reward>")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["team", "conversation_id"])]
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.value} on {self.completion_id or self.conversation_id}"


class ModelAlias(models.Model):
    """A name the gateway resolves to one of a model's checkpoints (``support/agent:prod``), with
    a share of its traffic sent to a candidate checkpoint (a canary), sticky per conversation.
    Every change is an ``AliasEvent`` with who and when."""

    TEAM_PATH = "model__project__team"
    model = models.ForeignKey("projects.TrainableModel", on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=32)
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.RESTRICT, related_name="+")
    candidate = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.RESTRICT, related_name="+"
    )
    candidate_share = models.FloatField(default=0.0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "name"], name="unique_alias_per_model")]
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.model}:{self.name}"


class AliasAction(models.TextChoices):
    SET = "set"  # the alias names a checkpoint (created, or moved by hand)
    CANARY = "canary"  # a candidate gets a share of the traffic
    PROMOTE = "promote"  # the candidate becomes the checkpoint
    ROLLBACK = "rollback"  # the candidate is dropped, or the checkpoint goes back to the one before


class AliasEvent(models.Model):
    TEAM_PATH = "alias__model__project__team"
    alias = models.ForeignKey(ModelAlias, on_delete=models.CASCADE, related_name="events")
    action = models.CharField(max_length=16, choices=AliasAction.choices)
    checkpoint_step = models.PositiveIntegerField()
    candidate_step = models.PositiveIntegerField(null=True, blank=True)
    candidate_share = models.FloatField(default=0.0)
    previous_step = models.PositiveIntegerField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.action} {self.alias_id} at step {self.checkpoint_step}"


class GradingStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class CompletionGrading(models.Model):
    """A reward definition run over a filtered set of stored completions, in the background
    (projects.jobs.completions): every completion graded gets a CompletionFeedback with source
    ``grader:<reward>``. Completions that share a prompt are graded as one group, so RULER (and
    any grader that compares a group) ranks them against each other."""

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="completion_gradings")
    reward = models.ForeignKey("projects.RewardDefinition", on_delete=models.CASCADE, related_name="+")
    judge_endpoint = models.CharField(max_length=63, blank=True, default="")
    filters = models.JSONField(default=dict, blank=True)
    limit = models.PositiveIntegerField(default=1000)
    status = models.CharField(max_length=16, choices=GradingStatus.choices, default=GradingStatus.QUEUED)
    total = models.PositiveIntegerField(default=0)
    graded = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    mean_reward = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"grading {self.pk} ({self.status})"
