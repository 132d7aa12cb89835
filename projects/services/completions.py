"""Stored completions (projects.models.completions): written by the gateway after a reply has
gone (projects.gateway.capture), their metadata changed and rows deleted over OpenAI's API, the
team's storage settings, and retention.

A completion id is unique across teams; a second row with an id already stored (a server that
reused one) is dropped with a warning rather than overwriting another completion.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from projects.errors import NotFound, ValidationFailed
from projects.models import (
    ApiKey,
    BaseModel,
    CompletionFeedback,
    CompletionGrading,
    CompletionStorage,
    Project,
    RewardDefinition,
    StoredCompletion,
    TaskSet,
    Team,
    TrainableModel,
)
from projects.selectors.completions import stored_completions
from projects.services._common import jsonb_safe
from projects.services.task_sets import task_set_create

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


def _storage_mode(value: Any, field: str) -> str:
    if value not in CompletionStorage.values:
        raise ValidationFailed(f"must be one of {', '.join(CompletionStorage.values)}", field=field)
    return str(value)


def completion_storage_set(
    *,
    team: Team,
    storage: str | None = None,
    retention_days: Any = ...,
    conversation_key: str | None = None,
    per_model: dict[str, Any] | None = None,
) -> Team:
    """The team's storage settings; each argument left out stays as it is. ``retention_days``
    None keeps rows forever. ``per_model`` replaces the per-model settings: each key names one of
    the team's models (``project/model``) or a base model."""
    fields = []
    if storage is not None:
        team.completion_storage = _storage_mode(storage, "completion_storage")
        fields.append("completion_storage")
    if per_model is not None:
        team.completion_storage_models = _per_model_storage(team, per_model)
        fields.append("completion_storage_models")
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


MAX_PER_MODEL = 200


def _per_model_storage(team: Team, per_model: dict[str, Any]) -> dict[str, str]:
    field = "completion_storage_models"
    if not isinstance(per_model, dict) or len(per_model) > MAX_PER_MODEL:
        raise ValidationFailed(f"must be an object of at most {MAX_PER_MODEL} models", field=field)
    known = {
        f"{project}/{name}"
        for project, name in TrainableModel.objects.filter(project__team=team).values_list(
            "project__name", "name"
        )
    } | set(BaseModel.objects.values_list("name", flat=True))
    checked = {}
    for name, mode in per_model.items():
        if name not in known:
            raise ValidationFailed(
                f"{str(name)[:100]!r} is none of this team's models (project/model) nor a base model",
                field=field,
            )
        checked[name] = _storage_mode(mode, f"{field}.{name}")
    return checked


def api_key_storage_set(*, api_key: ApiKey, storage: str) -> ApiKey:
    """Which of the key's completions are stored: "" follows the team; else over the team's."""
    api_key.completion_storage = storage and _storage_mode(storage, "completion_storage")
    api_key.save(update_fields=["completion_storage"])
    return api_key


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


MAX_LABEL, MAX_COMMENT = 64, 4000


def feedback_add(
    *,
    team: Team,
    value: Any,
    completion: StoredCompletion | None = None,
    conversation_id: str = "",
    label: str = "",
    comment: str = "",
    source: str = "api",
    api_key: ApiKey | None = None,
    created_by: Any = None,
) -> CompletionFeedback:
    """A reward on one stored completion or on every completion of a conversation (exactly one
    of the two); it becomes their ``reward`` (the newest feedback wins)."""
    if (completion is None) == (not conversation_id):
        raise ValidationFailed("give exactly one of completion_id or conversation_id", field="completion_id")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValidationFailed("must be a finite number (a thumbs up is 1, down 0)", field="value")
    if not isinstance(label, str) or len(label) > MAX_LABEL:
        raise ValidationFailed(f"must be a string of at most {MAX_LABEL} characters", field="label")
    if not isinstance(comment, str) or len(comment) > MAX_COMMENT:
        raise ValidationFailed(f"must be a string of at most {MAX_COMMENT} characters", field="comment")
    rows = StoredCompletion.objects.filter(team=team)
    if completion is not None:
        if completion.team_id != team.pk:
            raise NotFound("No chat completion found with that id.")
        rows = rows.filter(pk=completion.pk)
    else:
        rows = rows.filter(conversation_id=conversation_id)
        if not rows.exists():
            raise ValidationFailed(f"no stored completion has conversation id {conversation_id[:100]!r}",
                                   field="conversation_id")  # fmt: skip
    with transaction.atomic():
        feedback = CompletionFeedback.objects.create(
            team=team, completion=completion, conversation_id=conversation_id if completion is None else "",
            value=float(value), label=jsonb_safe(label), comment=jsonb_safe(comment), source=source[:100],
            api_key=api_key, created_by=created_by,
        )  # fmt: skip
        rows.update(reward=float(value), feedback_count=F("feedback_count") + 1)
    return feedback


def task_set_from_completions(
    *,
    project: Project,
    name: str,
    completions: list[StoredCompletion],
    validation_fraction: float = 0.0,
    pairs: bool = False,
) -> TaskSet:
    """A task set of the project from stored completions (the team's, checked): per completion
    one row, its prompt as ``messages``, its metadata (with ``completion_id``, ``served_by`` and
    ``reward``) as the grader's ``item``, and the reply as ``completion`` (what an SFT run trains
    on). The task set's source names the completions, so a run on it leads back to the traffic."""
    if not completions:
        raise ValidationFailed("select at least one stored completion", field="completions")
    if any(row.team_id != project.team_id for row in completions):
        raise NotFound("No chat completion found with that id.")
    if pairs:
        rows = _preference_rows(completions)
        if not rows:
            raise ValidationFailed(
                "no prompt has two rated completions with different rewards to pair", field="completions"
            )
        return _task_set_of(project, name, rows, completions, validation_fraction)
    rows = []
    for row in completions:
        messages = row.sent_messages
        reply = _reply_text(row)
        item = {
            **row.metadata,
            "completion_id": row.completion_id,
            "served_by": row.served_by,
            "reward": row.reward,
        }
        data: dict[str, Any] = {"messages": messages, "item": item}
        if reply is not None:
            data["completion"] = reply
        rows.append(data)
    return _task_set_of(project, name, rows, completions, validation_fraction)


def _reply_text(row: StoredCompletion) -> str | None:
    choices = row.response.get("choices") or [{}]
    reply = (choices[0].get("message") or {}).get("content") if isinstance(choices[0], dict) else None
    return reply if isinstance(reply, str) and reply else None


def _preference_rows(completions: list[StoredCompletion]) -> list[dict[str, Any]]:
    """Per prompt with rated replies of different rewards: the best as ``chosen``, the worst as
    ``rejected`` (a DPO run's rows)."""
    by_prompt: dict[str, list[StoredCompletion]] = {}
    for row in completions:
        if row.reward is not None and _reply_text(row) is not None:
            messages = row.sent_messages
            by_prompt.setdefault(json.dumps(messages, sort_keys=True), []).append(row)
    rows = []
    for members in by_prompt.values():
        ranked = sorted(members, key=lambda row: (-(row.reward or 0.0), row.pk))
        best, worst = ranked[0], ranked[-1]
        if best.reward == worst.reward:
            continue
        rows.append({
            "messages": best.sent_messages,
            "chosen": _reply_text(best), "rejected": _reply_text(worst),
            "item": {**best.metadata, "chosen_id": best.completion_id, "rejected_id": worst.completion_id,
                     "chosen_reward": best.reward, "rejected_reward": worst.reward},
        })  # fmt: skip
    return rows


def _task_set_of(
    project: Project,
    name: str,
    rows: list[dict[str, Any]],
    completions: list[StoredCompletion],
    fraction: float,
) -> TaskSet:
    task_set = task_set_create(project=project, name=name, rows=rows, validation_fraction=fraction)
    task_set.source = {**(task_set.source or {}), "type": "stored_completions",
                       "completion_ids": [row.completion_id for row in completions]}  # fmt: skip
    task_set.save(update_fields=["source"])
    return task_set


def stored_completions_purge(
    *, team: Team, metadata: dict[str, str] | None = None, api_key_id: Any = None
) -> int:
    """Delete the team's stored completions whose metadata has every pair of ``metadata``, or
    that ``api_key_id`` made (at least one of the two); how many went."""
    if not metadata and api_key_id is None:
        raise ValidationFailed("give metadata pairs or an api_key to purge by", field="metadata")
    rows = stored_completions(team=team, metadata=metadata or {})
    if api_key_id is not None:
        if isinstance(api_key_id, bool) or not isinstance(api_key_id, int):
            raise ValidationFailed("must be an API key's id", field="api_key")
        rows = rows.filter(api_key_id=api_key_id)
    _, deleted = StoredCompletion.objects.filter(pk__in=list(rows.values_list("pk", flat=True))).delete()
    return deleted.get(StoredCompletion._meta.label, 0)


MAX_GRADING_LIMIT = 10_000


def completion_grading_create(
    *,
    team: Team,
    reward: RewardDefinition,
    filters: dict[str, Any] | None = None,
    limit: int = 1000,
    judge_endpoint: str = "",
    created_by: Any = None,
) -> CompletionGrading:
    """Queue ``reward`` over the team's stored completions that ``filters`` select (``model``,
    ``metadata``, ``rated``: the list's filters), at most ``limit`` of them, newest first."""
    if reward.project.team_id != team.pk:
        raise NotFound("No reward definition found with that id.")
    filters = dict(filters or {})
    unknown = set(filters) - {"model", "metadata", "rated"}
    if unknown:
        raise ValidationFailed(
            f"unknown filter {sorted(unknown)[0]!r} (model, metadata, rated)", field="filters"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_GRADING_LIMIT:
        raise ValidationFailed(f"must be from 1 to {MAX_GRADING_LIMIT}", field="limit")
    rows = stored_completions(team=team, model=filters.get("model"), metadata=filters.get("metadata") or {},
                              rated=filters.get("rated"))  # fmt: skip
    total = min(rows.count(), limit)
    if total == 0:
        raise ValidationFailed("no stored completion matches the filters", field="filters")
    grading = CompletionGrading.objects.create(
        team=team, reward=reward, filters=filters, limit=limit, judge_endpoint=judge_endpoint, total=total,
        created_by=created_by,
    )  # fmt: skip
    _enqueue_grading(grading.pk)
    return grading


def _enqueue_grading(grading_id: int) -> None:
    from projects.jobs.tasks import grade_stored_completions

    transaction.on_commit(lambda: grade_stored_completions.delay(grading_id))
