"""``/api/v1/aliases``: model aliases and canaries over REST (projects.services.aliases): a name
the gateway resolves to a checkpoint (``support/agent:prod``), a candidate's share of the
conversations, promotion and rollback (each an event with who and when), and the side-by-side of the
checkpoint and the candidate on the completions stored through the alias."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.api.base import TeamViewSet
from projects.api.pagination import list_body, page_of
from projects.api.serializers import InputSerializer, NoBodyIn
from projects.models import (
    AliasEvent,
    ModelAlias,
    TrainableModel,
)


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


class CheckpointFeedbackView(TeamViewSet):
    """``/api/v1/models/{model_id}/checkpoint-feedback``: each checkpoint of the model that served
    stored completions, side by side (completions, rated, mean reward, rated 0.5 or more, feedback,
    mean latency), newest step first: the comparison a promotion is decided on."""

    model = TrainableModel
    lookup_url_kwarg = "model_id"

    @extend_schema(operation_id="model_checkpoint_feedback", responses={200: dict})
    def list(self, request: Request, model_id: int) -> Response:
        return Response(list_body(selectors.checkpoint_feedback(model=self.get_object())))
