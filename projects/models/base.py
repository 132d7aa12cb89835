"""What several models share: the slug names users put in URLs and model ids, and three abstract
bases for rows of the same shape (named rows, event histories, claimed work). Abstract bases add
no tables and no migrations; each concrete model keeps its own Meta where it differs."""

from __future__ import annotations

import re
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils.deconstruct import deconstructible


# Deconstructs as the plain RegexValidator the migrations already hold, so matching the whole value
# changed no migration (the pattern's "$" stays, and fullmatch makes it harmless).
@deconstructible(path="django.core.validators.RegexValidator")
class WholeValueRegexValidator(RegexValidator):
    """A RegexValidator that the whole value must match: RegexValidator searches, and "$" also
    matches before a final newline, so "math\\n" passed "^[a-z0-9]...$"."""

    def __call__(self, value: Any) -> None:
        regex = cast(re.Pattern[str], self.regex)  # compiled in __init__ (the stubs also allow str)
        if regex.fullmatch(str(value)) is None:
            raise ValidationError(self.message, code=self.code, params={"value": value})


slug_validator = WholeValueRegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,62}$",
    "use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit",
)


def slug_name(*, unique: bool = False) -> models.CharField:
    """A name users put in URLs and model ids (``project/model:step``)."""
    return models.CharField(max_length=63, unique=unique, validators=[slug_validator])


class Named(models.Model):
    """A row its team names (unique within its owner, see each model's constraint), newest first."""

    name = slug_name()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.name


class ProjectResource(Named):
    """A named row of a project: its team is the project's."""

    TEAM_PATH = "project__team"

    class Meta(Named.Meta):
        abstract = True


class EventLevel(models.TextChoices):
    INFO = "info"
    WARN = "warn"
    ERROR = "error"


class Event(models.Model):
    """One entry of an insert-only history (OpenAI fine-tuning events shape), oldest first."""

    created_at = models.DateTimeField(auto_now_add=True)
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        abstract = True
        ordering = ["id"]

    def __str__(self) -> str:
        return f"[{self.level}] {self.message[:60]}"


class ClaimedWork(models.Model):
    """Work a worker claims and heartbeats (a run, a queued evaluation), newest first: who asked,
    which worker has it, how many workers claimed it, when it started and ended, and why it failed."""

    error = models.TextField(blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0, help_text="how many times a worker claimed it")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True
        ordering = ["-id"]
