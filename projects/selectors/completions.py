"""Reads of stored completions (projects.models.completions), scoped to the caller's team."""

from __future__ import annotations

from typing import Any

from django.db.models import Avg, Count, Max, Min, Q, QuerySet, Sum, TextField
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast

from projects.errors import NotFound, ValidationFailed
from projects.models import AliasEvent, CompletionFeedback, ModelAlias, StoredCompletion, Team, TrainableModel
from projects.selectors._scoping import scoped


def stored_completions(
    *,
    team: Team,
    model: str | None = None,
    metadata: dict[str, str] | None = None,
    descending: bool = False,
    after: str | None = None,
    checkpoint: str | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    rated: bool | None = None,
    since: Any = None,
    until: Any = None,
) -> QuerySet:
    """The team's stored completions, oldest first (``descending``: newest first); ``model``
    matches the id the request named or the checkpoint it resolved to; ``metadata`` every pair;
    ``after``: those past that completion in this order (a 400 on ``after`` if it is not listed);
    ``checkpoint`` the one that served it, ``reward_min``/``reward_max`` its reward (bounds
    included), ``rated`` whether it has any, ``since``/``until`` its time (datetimes)."""
    rows = scoped(StoredCompletion, team)
    if model:
        rows = rows.filter(Q(model=model) | Q(served_by=model))
    if checkpoint:
        rows = rows.filter(served_by=checkpoint)
    if reward_min is not None:
        rows = rows.filter(reward__gte=reward_min)
    if reward_max is not None:
        rows = rows.filter(reward__lte=reward_max)
    if rated is not None:
        rows = rows.filter(reward__isnull=not rated)
    if since is not None:
        rows = rows.filter(created_at__gte=since)
    if until is not None:
        rows = rows.filter(created_at__lt=until)
    for number, (key, value) in enumerate((metadata or {}).items()):
        name = f"_meta{number}"  # the key is data, never part of a lookup path
        text = Cast(KeyTextTransform(key, "metadata"), output_field=TextField())  # compared as text
        rows = rows.annotate(**{name: text}).filter(**{name: value})
    if after:
        anchor = rows.filter(completion_id=after).values_list("pk", flat=True).first()
        if anchor is None:
            raise ValidationFailed(f"no chat completion with id {after[:100]!r} in this list", field="after")
        rows = rows.filter(pk__lt=anchor) if descending else rows.filter(pk__gt=anchor)
    return rows.order_by("-id" if descending else "id")


def stored_completion_get(*, team: Team, completion_id: str) -> StoredCompletion:
    row = scoped(StoredCompletion, team).filter(completion_id=completion_id).first()
    if row is None:
        raise NotFound(f"No chat completion found with id '{completion_id[:100]}'.")
    return row


def completion_feedback(*, team: Team, completion: StoredCompletion) -> QuerySet:
    """The feedback on ``completion`` and on its conversation, newest first."""
    rows = scoped(CompletionFeedback, team).select_related("created_by")
    mine = Q(completion=completion)
    if completion.conversation_id:
        mine |= Q(completion__isnull=True, conversation_id=completion.conversation_id)
    return rows.filter(mine).order_by("-id")


MAX_CONVERSATION_TURNS = 500


def conversation(*, team: Team, conversation_id: str) -> list[StoredCompletion]:
    """A conversation's stored completions, oldest turn first (404 when it has none)."""
    if not conversation_id or "\x00" in conversation_id:
        raise NotFound("No conversation found with that id.")
    rows = list(
        scoped(StoredCompletion, team)
        .filter(conversation_id=conversation_id)
        .order_by("created_at", "id")[:MAX_CONVERSATION_TURNS]
    )
    if not rows:
        raise NotFound(f"No conversation found with id '{conversation_id[:100]}'.")
    return rows


def conversations(*, team: Team, after: str | None = None) -> QuerySet:
    """The team's conversations, the most recently continued first: id, turns, first and last
    turn's time (``after``: those listed after that conversation; a 400 on ``after`` if unknown)."""
    rows = (
        scoped(StoredCompletion, team)
        .exclude(conversation_id="")
        .values("conversation_id")
        .annotate(turns=Count("id"), first_at=Min("created_at"), last_at=Max("created_at"), last_pk=Max("id"))
    )
    if after:
        anchor = (
            rows.filter(conversation_id=after).order_by("-last_pk").values_list("last_pk", flat=True).first()
        )
        if anchor is None:
            raise ValidationFailed(f"no conversation with id {after[:100]!r} in this list", field="after")
        rows = rows.filter(last_pk__lt=anchor)
    return rows.order_by("-last_pk")


def checkpoint_feedback(*, model: TrainableModel) -> list[dict[str, Any]]:
    """Every checkpoint of ``model`` that served stored completions (through any name: its step,
    ``:latest``, an alias), side by side: completions, how many were rated, their mean reward, how
    many rated 0.5 or more, the feedback given on them and their mean latency; newest step first."""
    prefix = f"{model.project.name}/{model.name}:"
    rows = (
        StoredCompletion.objects.filter(team_id=model.project.team_id, served_by__startswith=prefix)
        .values("served_by")
        .annotate(
            completions=Count("id"),
            rated=Count("reward"),
            mean_reward=Avg("reward"),
            positive=Count("id", filter=Q(reward__gte=0.5)),
            feedback_given=Sum("feedback_count"),
            mean_latency_ms=Avg("latency_ms"),
        )  # fmt: skip
        .order_by()
    )
    out = []
    for row in rows:
        step = row["served_by"][len(prefix) :]
        if step.isdigit():
            out.append({
                "object": "checkpoint.feedback", "step": int(step), "served_by": row["served_by"],
                "completions": row["completions"], "rated": row["rated"], "mean_reward": row["mean_reward"],
                "positive": row["positive"], "feedback": row["feedback_given"] or 0,
                "mean_latency_ms": row["mean_latency_ms"],
            })  # fmt: skip
    return sorted(out, key=lambda row: -row["step"])


def alias_arms(*, alias: ModelAlias) -> list[dict[str, Any]]:
    """The alias's checkpoint and candidate side by side, from the completions stored through the
    alias: how many each served, how many were rated, their mean reward and mean latency."""
    model = alias.model
    name = f"{model.project.name}/{model.name}:{alias.name}"
    arms = [(alias.checkpoint, 1.0 - alias.candidate_share, "checkpoint")]
    if alias.candidate is not None:
        arms.append((alias.candidate, alias.candidate_share, "candidate"))
    out = []
    for checkpoint, share, role in arms:
        served_by = f"{model.project.name}/{model.name}:{checkpoint.step}"
        rows = StoredCompletion.objects.filter(team_id=model.project.team_id, model=name, served_by=served_by)
        stats = rows.aggregate(
            completions=Count("id"),
            rated=Count("reward"),
            mean_reward=Avg("reward"),
            mean_latency_ms=Avg("latency_ms"),
        )
        out.append({"role": role, "step": checkpoint.step, "share": round(share, 6), **stats})
    return out


def alias_events(*, alias: ModelAlias, limit: int = 50) -> list[AliasEvent]:
    return list(
        AliasEvent.objects.filter(alias=alias).select_related("created_by", "api_key").order_by("-id")[:limit]
    )


def model_aliases(*, team: Team, model_id: int) -> list[ModelAlias]:
    return list(
        scoped(ModelAlias, team)
        .filter(model_id=model_id)
        .select_related("model__project", "checkpoint", "candidate")
        .order_by("name")
    )
