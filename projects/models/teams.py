"""Teams, their members and API keys, and the OpenAI-compatible endpoints a team configures."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from projects.models.base import slug_name
from projects.secrets import url_public


class CompletionStorage(models.TextChoices):
    """Which of the team's gateway completions are stored (projects.models.completions)."""

    OFF = "off"  # none: a request with ``store: true`` is a 400 naming ``store``
    REQUESTED = "requested"  # those sent with ``store: true``
    ALL = "all"  # every one not sent with ``store: false``


class Team(models.Model):
    name = slug_name(unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Stored completions (OpenAI's ``store``): off until an owner turns them on.
    completion_storage = models.CharField(
        max_length=16, choices=CompletionStorage.choices, default=CompletionStorage.OFF
    )
    completion_retention_days = models.PositiveIntegerField(
        null=True, blank=True, help_text="stored completions older than this are deleted; empty: kept"
    )
    conversation_key = models.CharField(
        max_length=64, default="conversation_id",
        help_text="the metadata key whose value joins stored completions into one conversation",
    )  # fmt: skip
    # Per model: {"project/model": "off" | "requested" | "all"}, over completion_storage for
    # requests naming that model (any of its checkpoints or aliases); a key's own setting wins.
    completion_storage_models = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return self.name


class Role(models.TextChoices):
    OWNER = "owner"
    MEMBER = "member"
    VIEWER = "viewer"


class Membership(models.Model):
    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)
    # When the person last chose this team in the dashboard: their remembered team, across sessions.
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="unique_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class Invitation(models.Model):
    """An owner's offer of a role in a team; joining needs the invitee to accept it (consent).

    ``invitee`` is the email or username as the owner typed it and is never checked against the
    user table (an invitation reveals nothing about who has an account). Like an API key, only a
    SHA-256 of the token is stored (``prefix`` finds the row); the plaintext is shown once. An
    invitation is pending until it is accepted, revoked or past ``expires_at``; each is used once.
    """

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invitations")
    invitee = models.CharField(max_length=254)
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    prefix = models.CharField(max_length=16, unique=True)
    token_hash = models.CharField(max_length=64)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.invitee} to {self.team} ({self.role})"


class ApiKey(models.Model):
    """A team API key. Only a SHA-256 of the key is stored; the plaintext is shown once.

    Keys are 256-bit random strings, so a fast hash is enough (no brute force is feasible); the
    public ``prefix`` finds the row without scanning and is safe to display.
    """

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    read_only = models.BooleanField(default=False)
    # Stored completions of this key's requests: "" follows the team (and its per-model
    # settings); otherwise one of CompletionStorage, over both.
    completion_storage = models.CharField(max_length=16, blank=True, default="")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None


class JudgeEndpoint(models.Model):
    """An OpenAI-compatible endpoint a team's LLM-judge graders call (score_model, label_model,
    ruler). The API key is encrypted at rest (projects.secrets) and never returned by the API."""

    TEAM_PATH = "team"
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="judge_endpoints")
    name = slug_name()
    base_url = models.URLField(max_length=500)
    api_key_encrypted = models.TextField(blank=True, default="")
    default_model = models.CharField(max_length=200, blank=True, default="")
    timeout_s = models.FloatField(default=60.0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "name"], name="unique_judge_endpoint_name")]
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({url_public(self.base_url)})"
