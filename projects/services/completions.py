"""Stored completions (projects.models.completions): written by the gateway after a reply has
gone (projects.gateway.capture), their metadata changed and rows deleted over OpenAI's API, the
team's storage settings, and retention.

A completion id is unique across teams; a second row with an id already stored (a server that
reused one) is dropped with a warning rather than overwriting another completion.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from projects.errors import ValidationFailed
from projects.models import CompletionStorage, StoredCompletion, Team
from projects.services._common import jsonb_safe

log = logging.getLogger(__name__)

MAX_RETENTION_DAYS = 36_500


def stored_completion_create(
    *,
    team_id: int,
    completion_id: str,
    api_key_id: int | None,
    model: str,
    served_by: str,
    checkpoint_id: int | None,
    stream: bool,
    metadata: dict[str, str],
    conversation_id: str,
    request: dict[str, Any],
    response: dict[str, Any],
    prompt_token_ids: list[int] | None,
    token_ids: list[list[int] | None] | None,
    logprobs: list[list[float] | None] | None,
    latency_ms: int,
    bounded: bool = False,
) -> StoredCompletion | None:
    try:
        with transaction.atomic():
            return StoredCompletion.objects.create(
                team_id=team_id, completion_id=completion_id[:100], api_key_id=api_key_id,
                model=model[:300], served_by=served_by[:300], checkpoint_id=checkpoint_id, stream=stream,
                metadata=jsonb_safe(metadata), conversation_id=conversation_id[:512],
                request=jsonb_safe(request), response=jsonb_safe(response),
                prompt_token_ids=prompt_token_ids, token_ids=token_ids, logprobs=logprobs,
                latency_ms=max(0, latency_ms), bounded=bounded, created_at=timezone.now(),
            )  # fmt: skip
    except IntegrityError:
        log.warning("completion %s is stored already: the second one is not stored", completion_id)
        return None


def stored_completion_update(*, completion: StoredCompletion, metadata: dict[str, str]) -> StoredCompletion:
    """OpenAI's update: ``metadata`` replaces the stored one (the conversation follows its key)."""
    key = Team.objects.values_list("conversation_key", flat=True).get(pk=completion.team_id)
    completion.metadata = jsonb_safe(metadata)
    completion.conversation_id = metadata.get(key, "")[:512]
    completion.save(update_fields=["metadata", "conversation_id"])
    return completion


def stored_completion_delete(*, completion: StoredCompletion) -> None:
    completion.delete()


def completion_storage_set(
    *, team: Team, storage: str | None = None, retention_days: Any = ..., conversation_key: str | None = None
) -> Team:
    """The team's storage settings; each argument left out stays as it is. ``retention_days``
    None keeps rows forever."""
    fields = []
    if storage is not None:
        if storage not in CompletionStorage.values:
            raise ValidationFailed(
                f"must be one of {', '.join(CompletionStorage.values)}", field="completion_storage"
            )
        team.completion_storage = storage
        fields.append("completion_storage")
    if retention_days is not ...:
        if retention_days is not None and (
            isinstance(retention_days, bool) or not isinstance(retention_days, int)
            or not 1 <= retention_days <= MAX_RETENTION_DAYS
        ):  # fmt: skip
            raise ValidationFailed(
                f"must be a whole number of days from 1 to {MAX_RETENTION_DAYS}, or null",
                field="completion_retention_days",
            )
        team.completion_retention_days = retention_days
        fields.append("completion_retention_days")
    if conversation_key is not None:
        if not 1 <= len(conversation_key) <= 64 or "\x00" in conversation_key:
            raise ValidationFailed("must be a metadata key of 1 to 64 characters", field="conversation_key")
        team.conversation_key = conversation_key
        fields.append("conversation_key")
    if fields:
        team.save(update_fields=fields)
    return team


def stored_completions_expire(*, now: Any = None) -> int:
    """Delete every team's stored completions older than its retention; how many went."""
    now = now or timezone.now()
    deleted = 0
    for team_id, days in Team.objects.filter(completion_retention_days__isnull=False).values_list(
        "pk", "completion_retention_days"
    ):
        cutoff = now - timedelta(days=days or 0)
        count, _ = StoredCompletion.objects.filter(team_id=team_id, created_at__lt=cutoff).delete()
        deleted += count
    return deleted
