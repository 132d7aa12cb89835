"""OpenAI's stored chat completions under ``/v1/chat/completions`` (list, retrieve, update,
delete, messages), so the ``openai`` client's ``chat.completions.list/retrieve/update/delete``
and ``chat.completions.messages.list`` read what the gateway stored (projects.gateway.capture),
and ``/api/v1/team``, where an owner turns storage on and sets its retention.

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

from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.http import StreamingHttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.access import Permission
from projects.api.base import TeamViewSet
from projects.api.pagination import int_query_param, list_body, page_of
from projects.api.serializers import InputSerializer, NoBodyIn
from projects.errors import NotFound, ValidationFailed
from projects.gateway.capture import checked_metadata
from projects.gateway.errors import GatewayError
from projects.models import (
    AliasEvent,
    CompletionFeedback,
    CompletionGrading,
    ModelAlias,
    RewardDefinition,
    StoredCompletion,
    TrainableModel,
)
from projects.services.judges import judge_client as judge_client_check

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


class TeamSettingsIn(InputSerializer):
    completion_storage = serializers.ChoiceField(choices=["off", "requested", "all"], required=False)
    completion_retention_days = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                                         max_value=services.completions.MAX_RETENTION_DAYS)  # fmt: skip
    conversation_key = serializers.CharField(required=False, min_length=1, max_length=64)


def team_body(team: Any) -> dict[str, Any]:
    return {
        "name": team.name,
        "completion_storage": team.completion_storage,
        "completion_retention_days": team.completion_retention_days,
        "conversation_key": team.conversation_key,
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
        )
        return Response(team_body(team))


class FeedbackIn(InputSerializer):
    completion_id = serializers.CharField(
        required=False, max_length=100, help_text="a stored completion's id"
    )
    conversation_id = serializers.CharField(required=False, max_length=512,
                                            help_text="every stored completion of this conversation")  # fmt: skip
    value = serializers.FloatField(help_text="the reward: a thumbs up is 1, down 0; any finite number")
    label = serializers.CharField(required=False, allow_blank=True, max_length=64)  # type: ignore[assignment]
    comment = serializers.CharField(required=False, allow_blank=True, max_length=4000)


def feedback_body(row: CompletionFeedback) -> dict[str, Any]:
    return {
        "id": row.pk,
        "object": "completion.feedback",
        "completion_id": row.completion.completion_id if row.completion is not None else None,
        "conversation_id": row.conversation_id or None,
        "value": row.value,
        "label": row.label,
        "comment": row.comment,
        "source": row.source,
        "created_at": int(row.created_at.timestamp()),
    }


class FeedbackView(TeamViewSet):
    """``/api/v1/feedback``: rewards attached to stored completions or conversations after the fact
    (projects.services.completions.feedback_add); ``?completion_id=`` or ``?conversation_id=``."""

    model = CompletionFeedback
    serializer_class = FeedbackIn

    def base_queryset(self) -> QuerySet:
        return CompletionFeedback.objects.select_related("completion")

    @extend_schema(operation_id="feedback_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        rows = self.get_queryset()
        if completion_id := request.query_params.get("completion_id"):
            rows = rows.filter(completion__completion_id=completion_id)
        if conversation_id := request.query_params.get("conversation_id"):
            rows = rows.filter(conversation_id=conversation_id)
        page, has_more = page_of(rows, request)
        return Response(list_body([feedback_body(row) for row in page], has_more=has_more))

    @extend_schema(responses={200: dict})
    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(feedback_body(self.get_object()))

    @extend_schema(request=FeedbackIn, responses={201: dict})
    def create(self, request: Request) -> Response:
        serializer = FeedbackIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        completion = None
        if data.get("completion_id"):
            try:
                completion = selectors.stored_completion_get(
                    team=self.team, completion_id=data["completion_id"]
                )
            except NotFound as exc:
                raise ValidationFailed(exc.message, field="completion_id") from exc
        row = services.feedback_add(
            team=self.team, value=data["value"], completion=completion,
            conversation_id=data.get("conversation_id", ""), label=data.get("label", ""),
            comment=data.get("comment", ""), source="api", api_key=self.access.api_key,
            created_by=request.user if isinstance(request.user, User) else None,  # a key is no one
        )  # fmt: skip
        return Response(feedback_body(row), status=status.HTTP_201_CREATED)


# ---------------------------------------------------------------- model aliases and canaries


class AliasIn(InputSerializer):
    model = serializers.IntegerField(help_text="the trainable model's id")
    name = serializers.CharField(max_length=32, help_text="e.g. prod: called as <project>/<model>:prod")
    checkpoint = serializers.IntegerField(min_value=0, help_text="the step it names")


class CanaryIn(InputSerializer):
    checkpoint = serializers.IntegerField(min_value=0, help_text="the candidate's step")
    share = serializers.FloatField(
        help_text="the fraction of conversations sent to it, above 0 and at most 1"
    )


def _who(event: AliasEvent) -> str | None:
    if event.created_by is not None:
        return event.created_by.username
    return f"key {event.api_key.name}" if event.api_key is not None else None


def alias_body(alias: ModelAlias, *, detail: bool = False) -> dict[str, Any]:
    model = alias.model
    body: dict[str, Any] = {
        "id": alias.pk,
        "object": "model.alias",
        "name": f"{model.project.name}/{model.name}:{alias.name}",
        "model": model.pk,
        "checkpoint": alias.checkpoint.step,
        "candidate": alias.candidate.step if alias.candidate else None,
        "candidate_share": alias.candidate_share,
        "updated_at": int(alias.updated_at.timestamp()),
    }
    if detail:
        body["arms"] = selectors.alias_arms(alias=alias)
        body["events"] = [
            {"id": e.pk, "action": e.action, "checkpoint": e.checkpoint_step, "candidate": e.candidate_step,
             "candidate_share": e.candidate_share, "previous": e.previous_step, "by": _who(e),
             "created_at": int(e.created_at.timestamp())}
            for e in selectors.alias_events(alias=alias)
        ]  # fmt: skip
    return body


class AliasView(TeamViewSet):
    """``/api/v1/aliases``: names the gateway resolves to a checkpoint (``support/agent:prod``),
    canaries (a candidate's share of the conversations), promotion and rollback, each an event
    with who and when; the detail compares the checkpoint and the candidate on the completions
    stored through the alias (projects.services.aliases)."""

    model = ModelAlias
    serializer_class = AliasIn

    def base_queryset(self) -> QuerySet:
        return ModelAlias.objects.select_related("model__project", "checkpoint", "candidate")

    def _by(self) -> dict[str, Any]:
        user = self.request.user
        return {"by": user if isinstance(user, User) else None, "api_key": self.access.api_key}

    @extend_schema(operation_id="aliases_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        page, has_more = page_of(self.get_queryset(), request)
        return Response(list_body([alias_body(alias) for alias in page], has_more=has_more))

    @extend_schema(responses={200: dict})
    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(alias_body(self.get_object(), detail=True))

    @extend_schema(request=AliasIn, responses={201: dict})
    def create(self, request: Request) -> Response:
        serializer = AliasIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = self.ref(TrainableModel, data["model"], "model")
        alias = services.alias_set(model=model, name=data["name"], step=data["checkpoint"], **self._by())
        return Response(alias_body(alias, detail=True), status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        services.alias_delete(alias=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=CanaryIn, responses={200: dict})
    @action(detail=True, methods=["post"])
    def canary(self, request: Request, pk: str) -> Response:
        serializer = CanaryIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        alias = services.alias_canary(alias=self.get_object(), step=data["checkpoint"], share=data["share"],
                                      **self._by())  # fmt: skip
        return Response(alias_body(alias, detail=True))

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, pk: str) -> Response:
        NoBodyIn(data=request.data).is_valid(raise_exception=True)
        return Response(
            alias_body(services.alias_promote(alias=self.get_object(), **self._by()), detail=True)
        )

    @extend_schema(request=None, responses={200: dict})
    @action(detail=True, methods=["post"])
    def rollback(self, request: Request, pk: str) -> Response:
        NoBodyIn(data=request.data).is_valid(raise_exception=True)
        return Response(
            alias_body(services.alias_rollback(alias=self.get_object(), **self._by()), detail=True)
        )


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


# ---------------------------------------------------------------- grading in the background


class GradingIn(InputSerializer):
    reward = serializers.IntegerField(help_text="a reward definition's id (any grader, ruler included)")
    filters = serializers.DictField(required=False, help_text="{model, metadata: {k: v}, rated: bool}")
    limit = serializers.IntegerField(required=False, default=1000, min_value=1,
                                     max_value=services.completions.MAX_GRADING_LIMIT)  # fmt: skip
    judge_endpoint = serializers.CharField(required=False, allow_blank=True, max_length=63)


def grading_body(grading: CompletionGrading) -> dict[str, Any]:
    return {
        "id": grading.pk,
        "object": "completion.grading",
        "reward": grading.reward_id,
        "filters": grading.filters,
        "status": grading.status,
        "total": grading.total,
        "graded": grading.graded,
        "errors": grading.errors,
        "mean_reward": grading.mean_reward,
        "error": grading.error or None,
        "created_at": int(grading.created_at.timestamp()),
        "finished_at": int(grading.finished_at.timestamp()) if grading.finished_at else None,
    }


class CompletionGradingView(TeamViewSet):
    """``/api/v1/completion-gradings``: a reward definition run over stored completions in the
    background (projects.jobs.completions); each graded completion gets feedback from it."""

    model = CompletionGrading
    serializer_class = GradingIn

    @extend_schema(operation_id="completion_gradings_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        page, has_more = page_of(self.get_queryset(), request)
        return Response(list_body([grading_body(row) for row in page], has_more=has_more))

    @extend_schema(responses={200: dict})
    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(grading_body(self.get_object()))

    @extend_schema(request=GradingIn, responses={201: dict})
    def create(self, request: Request) -> Response:
        serializer = GradingIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        reward = self.ref(RewardDefinition, data["reward"], "reward")
        filters = dict(data.get("filters") or {})
        if "metadata" in filters:
            if not isinstance(filters["metadata"], dict):
                raise ValidationFailed("filters.metadata must be an object of strings", field="filters")
            try:
                filters["metadata"] = checked_metadata(filters["metadata"])
            except GatewayError as exc:
                raise ValidationFailed(exc.message, field="filters") from exc
        if "rated" in filters and not isinstance(filters["rated"], bool):
            raise ValidationFailed("filters.rated must be true or false", field="filters")
        if "model" in filters and not isinstance(filters["model"], str):
            raise ValidationFailed("filters.model must be a model id", field="filters")
        if data.get("judge_endpoint"):
            judge_client_check(team=self.team, name=data["judge_endpoint"])
        user = request.user
        grading = services.completion_grading_create(
            team=self.team, reward=reward, filters=filters, limit=data["limit"],
            judge_endpoint=data.get("judge_endpoint", ""), created_by=user if isinstance(user, User) else None,
        )  # fmt: skip
        return Response(grading_body(grading), status=status.HTTP_201_CREATED)


# ---------------------------------------------------------------- training on what users saw


class TrainOnCompletionsIn(InputSerializer):
    model = serializers.IntegerField(help_text="the trainable model to train (its checkpoints served them)")
    completion_ids = serializers.ListField(child=serializers.CharField(max_length=100), required=False,
                                           max_length=MAX_LIMIT * 10)  # fmt: skip
    filters = serializers.DictField(required=False, help_text="{model, metadata: {k: v}}: rated completions")
    limit = serializers.IntegerField(required=False, default=1000, min_value=1, max_value=MAX_LIMIT * 10)
    experimental_config = serializers.JSONField(required=False, help_text="ART's: learning_rate, loss_fn …")


class TrainOnCompletionsView(TeamViewSet):
    """``/api/v1/stored-completions/train``: one off-policy training step of a model on stored
    completions and their rewards (projects.services.completions.training_job_from_completions);
    the answer is the training job, which ``/v1/preview/training-jobs/{id}`` follows."""

    serializer_class = TrainOnCompletionsIn

    @extend_schema(
        operation_id="stored_completions_train", request=TrainOnCompletionsIn, responses={201: dict}
    )
    def train(self, request: Request) -> Response:
        serializer = TrainOnCompletionsIn(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        model = self.ref(TrainableModel, data["model"], "model")
        if ("completion_ids" in data) == ("filters" in data):
            raise ValidationFailed("give completion_ids or filters", field="completion_ids")
        if "completion_ids" in data:
            rows = list(
                selectors.stored_completions(team=self.team).filter(completion_id__in=data["completion_ids"])
            )
            missing = set(data["completion_ids"]) - {row.completion_id for row in rows}
            if missing:
                raise ValidationFailed(f"no stored completion {sorted(missing)[0]!r} in your team",
                                       field="completion_ids")  # fmt: skip
        else:
            filters = data["filters"]
            metadata = filters.get("metadata") or {}
            if not isinstance(metadata, dict) or not isinstance(filters.get("model") or "", str):
                raise ValidationFailed("filters are {model: str, metadata: {k: v}}", field="filters")
            rows = list(selectors.stored_completions(team=self.team, model=filters.get("model") or None,
                                                     metadata=metadata, rated=True, descending=True)[: data["limit"]])  # fmt: skip
        user = request.user
        job, counts = services.training_job_from_completions(
            model=model, completions=rows, experimental_config=data.get("experimental_config"),
            created_by=user if isinstance(user, User) else None,
        )  # fmt: skip
        return Response({"object": "training_job", "id": job.pk, "status": job.status, "model": model.pk,
                         "counts": counts}, status=status.HTTP_201_CREATED)  # fmt: skip
