"""OpenAI's stored chat completions under ``/v1/chat/completions`` (list, retrieve, update,
delete, messages), so the ``openai`` client's ``chat.completions.list/retrieve/update/delete``
and ``chat.completions.messages.list`` read what the gateway stored (projects.gateway.capture),
``/api/v1/team``, where an owner turns storage on and sets its retention, and
``/api/v1/stored-completions/{export,purge}`` (JSONL; an owner's purge by metadata or key).
Feedback, grading and training on stored completions are projects.api.feedback; aliases,
projects.api.aliases.

DRF views on the tenancy base: team API keys or a signed-in member, the caller's team only
(another team's completion id is a 404), a read-only key cannot change or delete. Lists are
OpenAI's cursor pages: ``after`` is the last id seen, ``limit`` 1 to 100 (default 20), ``order``
``asc`` (default) or ``desc``; ``model`` matches the id the request named or the checkpoint it
resolved to, ``metadata[key]=value`` every pair given.

A retrieved completion is the reply as the client saw it, with ``metadata`` and, beside OpenAI's
fields, what training reads: ``served_by`` (the checkpoint), ``prompt_token_ids``, each choice's
sampled ``token_ids`` and ``sampled_logprobs``, and ``latency_ms``.
"""

from __future__ import annotations

import json
from typing import Any

from django.http import StreamingHttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.access import Permission
from projects.api.base import TeamViewSet
from projects.api.pagination import int_query_param, list_body
from projects.api.serializers import InputSerializer
from projects.errors import ValidationFailed
from projects.gateway.capture import checked_metadata
from projects.gateway.errors import GatewayError
from projects.models import (
    StoredCompletion,
)

DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def completion_body(row: StoredCompletion) -> dict[str, Any]:
    body = dict(row.response)
    body["id"] = row.completion_id
    body["object"] = "chat.completion"
    body.setdefault("created", int(row.created_at.timestamp()))
    body["model"] = body.get("model") or row.served_by
    body["metadata"] = row.metadata
    body["served_by"] = row.served_by
    body["latency_ms"] = row.latency_ms
    body["prompt_token_ids"] = row.prompt_token_ids
    choices = []
    for index, choice in enumerate(body.get("choices") or []):
        choice = dict(choice)
        if row.token_ids is not None and index < len(row.token_ids):
            choice["token_ids"] = row.token_ids[index]
        if row.logprobs is not None and index < len(row.logprobs):
            choice["sampled_logprobs"] = row.logprobs[index]
        choices.append(choice)
    body["choices"] = choices
    return body


def message_bodies(row: StoredCompletion) -> list[dict[str, Any]]:
    """The request's messages, each with an id (``<completion id>-<index>``), as OpenAI lists them."""
    messages = row.request.get("messages") or []
    out = []
    for index, message in enumerate(messages):
        item = {"id": f"{row.completion_id}-{index}", **message}
        item.setdefault("content", None)
        out.append(item)
    return out


def _limit(request: Request) -> int:
    limit = int_query_param(request, "limit", DEFAULT_LIMIT)
    if limit is None or not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(f"must be between 1 and {MAX_LIMIT}", field="limit")
    return limit


def _descending(request: Request) -> bool:
    order = request.query_params.get("order", "asc")
    if order not in ("asc", "desc"):
        raise ValidationFailed("must be asc or desc", field="order")
    return order == "desc"


def _metadata_filter(request: Request) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for name, value in request.query_params.items():
        if name.startswith("metadata[") and name.endswith("]"):
            pairs[name[len("metadata[") : -1]] = str(value)
        elif name == "metadata":
            raise ValidationFailed("filter with metadata[key]=value", field="metadata")
    return pairs


class MetadataIn(InputSerializer):
    metadata = serializers.DictField(child=serializers.CharField(allow_blank=True), allow_empty=True)


class StoredCompletionsView(TeamViewSet):
    model = StoredCompletion
    lookup_field = "completion_id"
    lookup_url_kwarg = "completion_id"
    serializer_class = MetadataIn  # what OPTIONS describes for the update

    @extend_schema(operation_id="chat_completions_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        descending = _descending(request)
        rows = selectors.stored_completions(
            team=self.team, model=request.query_params.get("model") or None,
            metadata=_metadata_filter(request), descending=descending, after=request.query_params.get("after"),
        )  # fmt: skip
        limit = _limit(request)
        page = list(rows[: limit + 1])
        return Response(list_body([completion_body(row) for row in page[:limit]], has_more=len(page) > limit))

    @extend_schema(responses={200: dict})
    def retrieve(self, request: Request, completion_id: str) -> Response:
        return Response(completion_body(self.get_object()))

    @extend_schema(request=MetadataIn, responses={200: dict})
    def update_metadata(self, request: Request, completion_id: str) -> Response:
        data = request.data if isinstance(request.data, dict) else None
        if data is None or set(data) != {"metadata"} or not isinstance(data["metadata"], dict | None):
            raise ValidationFailed('the body must be {"metadata": {key: value, …}}', field="metadata")
        try:
            metadata = checked_metadata(data["metadata"] or {})
        except GatewayError as exc:
            raise ValidationFailed(exc.message, field="metadata") from exc
        row = services.stored_completion_update(completion=self.get_object(), metadata=metadata)
        return Response(completion_body(row))

    @extend_schema(responses={200: dict})
    def destroy(self, request: Request, completion_id: str) -> Response:
        row = self.get_object()
        services.stored_completion_delete(completion=row)
        return Response({"object": "chat.completion.deleted", "id": completion_id, "deleted": True})

    @extend_schema(responses={200: dict})
    def messages(self, request: Request, completion_id: str) -> Response:
        items = message_bodies(self.get_object())
        if _descending(request):
            items.reverse()
        after = request.query_params.get("after")
        if after:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ValidationFailed(f"no message with id {after[:100]!r} in this list", field="after")
            items = items[ids.index(after) + 1 :]
        limit = _limit(request)
        return Response(list_body(items[:limit], has_more=len(items) > limit))


class ConversationsView(TeamViewSet):
    """``/api/v1/conversations``: stored completions joined by the team's ``conversation_key``,
    the most recently continued first; one conversation is its turns and their exact token join
    (projects.services.conversations): the samples its turns make and where each turn's sampled
    ids lie in them."""

    @extend_schema(operation_id="conversations_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        limit = _limit(request)
        page = list(
            selectors.conversations(team=self.team, after=request.query_params.get("after"))[: limit + 1]
        )
        items = [
            {"id": row["conversation_id"], "object": "conversation", "turns": row["turns"],
             "first_at": int(row["first_at"].timestamp()), "last_at": int(row["last_at"].timestamp())}
            for row in page[:limit]
        ]  # fmt: skip
        return Response(list_body(items, has_more=len(page) > limit))

    @extend_schema(operation_id="conversations_retrieve", responses={200: dict})
    def retrieve(self, request: Request, conversation_id: str) -> Response:
        rows = selectors.conversation(team=self.team, conversation_id=conversation_id)
        joined = services.conversation_tokens(rows)
        return Response({
            "id": conversation_id, "object": "conversation", "reward": rows[-1].reward,
            "first_at": int(rows[0].created_at.timestamp()), "last_at": int(rows[-1].created_at.timestamp()),
            **joined,
        })  # fmt: skip


class TeamSettingsIn(InputSerializer):
    completion_storage = serializers.ChoiceField(choices=["off", "requested", "all"], required=False)
    completion_retention_days = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                                         max_value=services.completions.MAX_RETENTION_DAYS)  # fmt: skip
    conversation_key = serializers.CharField(required=False, min_length=1, max_length=64)
    completion_storage_models = serializers.DictField(
        child=serializers.ChoiceField(choices=["off", "requested", "all"]), required=False,
        help_text="per model (project/model, or a base model): over completion_storage for its requests",
    )  # fmt: skip


def team_body(team: Any) -> dict[str, Any]:
    return {
        "name": team.name,
        "completion_storage": team.completion_storage,
        "completion_retention_days": team.completion_retention_days,
        "conversation_key": team.conversation_key,
        "completion_storage_models": team.completion_storage_models,
    }


class TeamSettingsView(TeamViewSet):
    """``/api/v1/team``: the caller's team and its settings; owners change them."""

    serializer_class = TeamSettingsIn
    write_permission = Permission.MANAGE

    @extend_schema(operation_id="team_retrieve", responses={200: dict})
    def list(self, request: Request) -> Response:
        return Response(team_body(self.team))

    @extend_schema(request=TeamSettingsIn, responses={200: dict})
    def partial_update(self, request: Request) -> Response:
        serializer = TeamSettingsIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        team = services.completion_storage_set(
            team=self.team,
            storage=data.get("completion_storage"),
            retention_days=data.get("completion_retention_days", ...),
            conversation_key=data.get("conversation_key"),
            per_model=data.get("completion_storage_models"),
        )
        return Response(team_body(team))


# ---------------------------------------------------------------- export and purge


class PurgeIn(InputSerializer):
    metadata = serializers.DictField(child=serializers.CharField(), required=False)
    api_key = serializers.IntegerField(required=False, help_text="the id of the key that made them")


class StoredCompletionsAdminView(TeamViewSet):
    """``/api/v1/stored-completions/export`` (JSONL, the same filters as the list) and
    ``/api/v1/stored-completions/purge`` (owners: by metadata pairs and/or the key that made them)."""

    serializer_class = PurgeIn
    write_permission = Permission.MANAGE

    @extend_schema(operation_id="stored_completions_export", responses={(200, "application/jsonl"): str})
    def export(self, request: Request) -> StreamingHttpResponse:
        rows = selectors.stored_completions(
            team=self.team,
            model=request.query_params.get("model") or None,
            metadata=_metadata_filter(request),
        )

        def lines() -> Any:
            for row in rows.iterator(chunk_size=500):
                body = completion_body(row)
                body["request"] = row.request
                yield json.dumps(body, ensure_ascii=False) + "\n"

        response = StreamingHttpResponse(lines(), content_type="application/jsonl")
        response["Content-Disposition"] = 'attachment; filename="stored-completions.jsonl"'
        return response

    @extend_schema(operation_id="stored_completions_purge", request=PurgeIn, responses={200: dict})
    def purge(self, request: Request) -> Response:
        serializer = PurgeIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        metadata = data.get("metadata") or {}
        if metadata:
            try:
                metadata = checked_metadata(metadata)
            except GatewayError as exc:
                raise ValidationFailed(exc.message, field="metadata") from exc
        deleted = services.stored_completions_purge(
            team=self.team, metadata=metadata, api_key_id=data.get("api_key")
        )
        return Response({"object": "stored_completions.purge", "deleted": deleted})
