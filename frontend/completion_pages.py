"""Stored completions in the dashboard: the review list (filters: model, checkpoint, metadata,
reward, date), the conversations (newest first), one completion as the trajectory viewer shows a transcript, with its feedback and a
form to rate it (thumbs or a score, a label, a comment), and a selection turned into a task set of a
project (prompts, metadata as items, replies as SFT targets). Every member reads; writers rate and
make task sets. Rows come through projects.selectors with ``request.team`` only; writes go through
projects.services.completions."""

from __future__ import annotations

from datetime import datetime, time, timedelta
from types import SimpleNamespace
from typing import Any

from django.contrib import messages
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from frontend.access import TeamHttpRequest, can_write, get_scoped, team_view
from frontend.presentation import Column, message_views
from projects import selectors, services
from projects.access import Permission
from projects.errors import DomainError, NotFound
from projects.models import ModelAlias, Project, StoredCompletion, TrainableModel

LIST_ROWS = 100


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw not in (None, "") else None
    except ValueError:
        return None


def _day(raw: str | None) -> datetime | None:
    try:
        day = datetime.strptime(raw or "", "%Y-%m-%d").date()
    except ValueError:
        return None
    return timezone.make_aware(datetime.combine(day, time.min), timezone.get_current_timezone())


def _filters(request: TeamHttpRequest) -> dict[str, Any]:
    """The list's filters from the query string; a value that does not parse is left out."""
    query = request.GET
    metadata = {}
    key, _, value = (query.get("meta") or "").partition("=")
    if key.strip() and value:
        metadata[key.strip()] = value.strip()
    until = _day(query.get("until"))
    rated = {"yes": True, "no": False}.get(query.get("rated", ""))
    return {
        "model": query.get("model") or None,
        "checkpoint": query.get("checkpoint") or None,
        "metadata": metadata,
        "reward_min": _float(query.get("reward_min")),
        "reward_max": _float(query.get("reward_max")),
        "rated": rated,
        "since": _day(query.get("since")),
        "until": until + timedelta(days=1) if until else None,  # the whole day named
    }


def _reply(row: StoredCompletion) -> str:
    choices = row.response.get("choices") or []
    message = (choices[0].get("message") or {}) if choices and isinstance(choices[0], dict) else {}
    if message.get("tool_calls"):
        return "→ " + ", ".join(
            str((c.get("function") or {}).get("name", "?")) for c in message["tool_calls"]
        )
    return str(message.get("content") or "")


def _prompt(row: StoredCompletion) -> str:
    for message in reversed(row.sent_messages):
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else str(content)
    return ""


@team_view()
def completions(request: TeamHttpRequest) -> HttpResponse:
    rows = list(
        selectors.stored_completions(team=request.team, descending=True, **_filters(request))[:LIST_ROWS]
    )
    projects = selectors.scoped(Project, request.team).order_by("name") if can_write(request) else []
    return render(request, "frontend/completions.html", {
        "rows": [(row, _prompt(row), _reply(row)) for row in rows],
        "limit": LIST_ROWS,
        "query": request.GET,
        "projects": projects,
        "can_write": can_write(request),
        "can_manage": request.access.allows(Permission.MANAGE),
        "storage_choices": [("off", "nothing"), ("requested", "those sent with store=true"),
                            ("all", "every completion not sent with store=false")],
        "storage": request.team.completion_storage,
    })  # fmt: skip


@require_POST
@team_view(owner=True)
def storage_settings(request: TeamHttpRequest) -> HttpResponse:
    """The team's storage settings from the list page (owners), as ``PATCH /api/v1/team`` sets them."""
    raw_days = (request.POST.get("retention_days") or "").strip()
    try:
        days = int(raw_days) if raw_days else None
        services.completion_storage_set(
            team=request.team, storage=request.POST.get("storage") or None, retention_days=days,
            conversation_key=(request.POST.get("conversation_key") or "").strip() or None,
        )  # fmt: skip
        messages.success(request, f"Storage: {request.team.completion_storage}.")
    except ValueError:
        messages.error(request, "Retention: a whole number of days, or empty to keep every row.")
    except DomainError as exc:
        messages.error(request, str(exc))
    return redirect("frontend:completions")


@team_view()
def conversations(request: TeamHttpRequest) -> HttpResponse:
    """The team's conversations, the most recently continued first, each with its newest turn."""
    rows = list(selectors.conversations(team=request.team)[:LIST_ROWS])
    newest = {
        row.pk: row
        for row in selectors.stored_completions(team=request.team).filter(pk__in=[r["last_pk"] for r in rows])
    }
    return render(request, "frontend/conversations.html", {
        "rows": [(r, newest[r["last_pk"]], _reply(newest[r["last_pk"]])) for r in rows if r["last_pk"] in newest],
        "limit": LIST_ROWS,
    })  # fmt: skip


@team_view()
def completion(request: TeamHttpRequest, completion_id: str) -> HttpResponse:
    try:
        row = selectors.stored_completion_get(team=request.team, completion_id=completion_id)
    except NotFound:
        raise Http404("no such stored completion") from None
    if request.method == "POST":  # a rating: team_view let only writers through
        value = _float(request.POST.get("value"))
        try:
            if value is None:
                raise DomainError("give a score, or use thumbs up or down", field="value")
            whole = request.POST.get("scope") == "conversation" and bool(row.conversation_id)
            services.feedback_add(
                team=request.team, value=value, completion=None if whole else row,
                conversation_id=row.conversation_id if whole else "", label=request.POST.get("label", "")[:64],
                comment=request.POST.get("comment", ""), source="dashboard", created_by=request.user,
            )  # fmt: skip
            messages.success(request, f"Rated {'the conversation ' if whole else ''}{value:g}.")
        except DomainError as exc:
            messages.error(request, str(exc))
        return redirect("frontend:completion", completion_id=row.completion_id)
    reply = (row.response.get("choices") or [{}])[0].get("message") or {}
    transcript = row.sent_messages + [reply]
    column = Column(
        SimpleNamespace(sub_rewards=None, errors=None, reward=row.reward), message_views(transcript), ""
    )
    token_ids = (row.token_ids or [None])[0]
    return render(request, "frontend/completion.html", {
        "row": row,
        "column": column,
        "feedback": list(selectors.completion_feedback(team=request.team, completion=row)[:50]),
        "prompt_tokens": len(row.prompt_token_ids or []),
        "completion_tokens": len(token_ids or []),
        "can_write": can_write(request),
        "conversation": services.conversation_tokens(
            selectors.conversation(team=request.team, conversation_id=row.conversation_id)
        ) if row.conversation_id else None,
    })  # fmt: skip


@require_POST
@team_view(write=True)
def completions_to_task_set(request: TeamHttpRequest) -> HttpResponse:
    ids = request.POST.getlist("completion")
    project = get_scoped(Project, request, request.POST.get("project") or 0)
    rows = list(selectors.stored_completions(team=request.team).filter(completion_id__in=ids))
    try:
        task_set = services.task_set_from_completions(
            project=project, name=request.POST.get("name", "").strip(), completions=rows,
            pairs=request.POST.get("rows") == "pairs",
        )  # fmt: skip
    except DomainError as exc:
        messages.error(request, f"No task set made: {exc}")
        return redirect("frontend:completions")
    messages.success(request, f"Task set {task_set.name} made from {len(rows)} stored completions.")
    return redirect("frontend:task-set", task_set_id=task_set.pk)


def _step(raw: str | None) -> int | None:
    return int(raw) if raw is not None and raw.isdigit() else None


@require_POST
@team_view(write=True)
def alias_set(request: TeamHttpRequest, model_id: int) -> HttpResponse:
    model = get_scoped(TrainableModel, request, model_id)
    try:
        alias = services.alias_set(model=model, name=request.POST.get("name", "").strip(),
                                   step=_step(request.POST.get("step")), by=request.user)  # fmt: skip
        messages.success(request, f"Alias :{alias.name} names step {alias.checkpoint.step}.")
    except DomainError as exc:
        messages.error(request, str(exc))
    return redirect("frontend:model", model_id=model.pk)


@require_POST
@team_view(write=True)
def alias_action(request: TeamHttpRequest, model_id: int, alias_id: int, verb: str) -> HttpResponse:
    model = get_scoped(TrainableModel, request, model_id)
    alias = get_scoped(ModelAlias, request, alias_id, model_id=model.pk)
    try:
        if verb == "canary":
            share = _float(request.POST.get("share"))
            alias = services.alias_canary(alias=alias, step=_step(request.POST.get("step")), share=share,
                                          by=request.user)  # fmt: skip
        elif verb == "promote":
            alias = services.alias_promote(alias=alias, by=request.user)
        elif verb == "rollback":
            alias = services.alias_rollback(alias=alias, by=request.user)
        else:
            raise Http404("no such action")
        messages.success(request, f"Alias :{alias.name}: {verb} done; it names step {alias.checkpoint.step}.")
    except DomainError as exc:
        messages.error(request, str(exc))
    return redirect("frontend:model", model_id=model.pk)
