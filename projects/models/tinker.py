"""The Tinker API (``/tinker/api/v1/``, projects.tinker): a client's sessions, its training
clients (each a TrainableModel with a run of kind ``tinker``), the futures it polls, and its
sampling sessions.

A Tinker training client's requests carry ``seq_id`` 1, 2, 3, ... and run in that order, one at a
time per model (projects.jobs.tinker); a future is the request's row, its result kept until read.
"""

from __future__ import annotations

from django.db import models

from projects.models.catalogue import BaseModel, Project, TrainableModel
from projects.models.runs import Checkpoint, Run
from projects.models.teams import Team


class TinkerSession(models.Model):
    """A client's session (``create_session``): what its training clients and samplers hang off."""

    TEAM_PATH = "team"
    id = models.CharField(primary_key=True, max_length=64)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="tinker_sessions")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="tinker_sessions")
    tags = models.JSONField(default=list, blank=True)
    user_metadata = models.JSONField(default=dict, blank=True)
    sdk_version = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"tinker session {self.id}"


class TinkerModel(models.Model):
    """A training client (``create_model``): ``"{session}:train:{n}"`` over a TrainableModel.

    ``done_seq`` is the last request executed; ``drainer`` the worker executing its queue now
    (empty when none), claimed under the row's lock so one worker at a time runs it.
    """

    TEAM_PATH = "session__team"
    id = models.CharField(primary_key=True, max_length=128)
    session = models.ForeignKey(TinkerSession, on_delete=models.CASCADE, related_name="models")
    model = models.OneToOneField(TrainableModel, on_delete=models.CASCADE, related_name="tinker")
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tinker_models")
    seq_base = models.PositiveIntegerField(
        default=0, help_text="the seq_id the first request after create_model carries, minus one"
    )
    done_seq = models.PositiveIntegerField(default=0)
    drainer = models.CharField(max_length=200, blank=True, default="")
    drained_at = models.DateTimeField(null=True, blank=True)
    steps = models.PositiveIntegerField(default=0, help_text="optim_steps taken")
    pending_loss = models.FloatField(
        default=0.0, help_text="forward_backward losses since the last optim_step"
    )
    pending_seconds = models.FloatField(
        default=0.0, help_text="device seconds of requests since the last optim_step"
    )
    opened = models.BooleanField(default=False, help_text="its session was opened on a trainer")
    lost = models.TextField(blank=True, default="", help_text="why the session's state is gone")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"tinker model {self.id}"


class TinkerFutureStatus(models.TextChoices):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"  # a sample its client abandoned (cancel_future)


class TinkerFuture(models.Model):
    """One request a client polls with ``retrieve_future``. Training requests of a model run in
    ``seq_id`` order; ``result`` is JSON, or protobuf bytes in ``blob`` (forward_backward, sample)."""

    TEAM_PATH = "team"
    id = models.CharField(primary_key=True, max_length=64)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="tinker_futures")
    model = models.ForeignKey(
        TinkerModel, null=True, blank=True, on_delete=models.CASCADE, related_name="futures"
    )
    kind = models.CharField(max_length=32)
    seq_id = models.PositiveIntegerField(null=True, blank=True)
    payload = models.JSONField(default=dict, blank=True)
    body = models.BinaryField(null=True, blank=True, help_text="a protobuf request body")
    status = models.CharField(
        max_length=16, choices=TinkerFutureStatus.choices, default=TinkerFutureStatus.PENDING
    )
    result = models.JSONField(null=True, blank=True)
    blob = models.BinaryField(null=True, blank=True, help_text="a protobuf result")
    error = models.TextField(blank=True, default="")
    category = models.CharField(max_length=16, blank=True, default="")
    seconds = models.FloatField(null=True, blank=True, help_text="device seconds it took")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["model", "seq_id"], name="unique_tinker_seq")]
        indexes = [models.Index(fields=["model", "status", "seq_id"])]

    def __str__(self) -> str:
        return f"tinker future {self.id} ({self.kind}, {self.status})"


class TinkerSampler(models.Model):
    """A sampling session: a base model, or a checkpoint's weights."""

    TEAM_PATH = "session__team"
    id = models.CharField(primary_key=True, max_length=128)
    session = models.ForeignKey(TinkerSession, on_delete=models.CASCADE, related_name="samplers")
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="tinker_samplers")
    checkpoint = models.ForeignKey(
        Checkpoint, null=True, blank=True, on_delete=models.CASCADE, related_name="tinker_samplers"
    )
    model_path = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"tinker sampler {self.id}"
