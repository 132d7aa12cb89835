"""``/v1/preview/``: client-driven training over OpenPipe ART's ServerlessBackend protocol, so an ART
program trains on artweb by changing one line (``ServerlessBackend(api_key=..., base_url=".../v1")``).

Under the gateway's ``/v1/`` (its lean ASGI entry point routes every ``/v1/`` path), but DRF views
derived from the tenancy base: API-key authentication, the caller's team only (another team's
model or job is a 404 before a body is read), the role table (a viewer or read-only key: 403 on
writes), OpenAI's error objects. Bodies up to ``PREVIEW_MAX_BODY_BYTES`` (413 beyond).

Protocol details the real client (openpipe-art 0.5.18, art/serverless/{client,backend}.py) forces:
- Ids are strings (``id: str``); cursor pages are OpenAI's (``data``, ``has_more``, ``last_id``)
  and ``after`` is the last id seen, sent back as a string of digits.
- ``register`` is ``POST /preview/models`` with ``return_existing: true`` and ``entity`` null the
  first time; the reply's ``entity`` (the team's name) goes into the inference name
  ``wandb-artifact:///{entity}/{project}/{name}[:step{N}]``, which the gateway resolves
  (projects.gateway.routing) with the same key at ``base_url``.
- ``get_step`` is the first checkpoint of ``GET .../checkpoints?limit=1&order=desc`` (0 when the
  list is empty): a registered model lists its step 0 at once.
- ``train`` posts the groups, then polls ``GET /preview/training-jobs/{id}/events?after=`` once a
  second. It advances ``after`` only past ``gradient_step`` events (a ``training_started`` is
  read again on every poll until then, harmlessly) and stops at ``training_ended`` or raises on
  ``training_failed {error_message}``. ``training_started.num_sequences`` is the number of
  ``gradient_step`` events that follow (one per job: one update), which the client reports as
  ``data/step_num_gradient_steps``. Right after ``training_ended`` it reads ``get_step``.
- POST requests are not retried by the client (its override), other methods are (3 times).

In the OpenAPI schema (``/api/v1/schema/``) beside the REST API, so the API fuzz covers it too.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import BaseParser
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.api.base import TeamViewSet
from projects.api.pagination import DEFAULT_LIMIT, MAX_LIMIT, list_body, page_of
from projects.api.serializers import refuse_unknown_fields
from projects.errors import NotFound, ValidationFailed
from projects.models import (
    Checkpoint,
    Run,
    TrainableModel,
    TrainingJob,
    TrainingJobEvent,
    TrainingJobEventType,
    TrainingJobStatus,
)
from training.rollouts import strict_json


class BodyTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"


class PreviewJSONParser(BaseParser):
    """JSON through training.rollouts.strict_json, like the API's parser, with the preview paths' own
    (larger) limit: trajectory groups with logprobs run to many megabytes."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        limit = settings.PREVIEW_MAX_BODY_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise BodyTooLarge(
                f"The request body is larger than the limit of {limit} bytes for /v1/preview/ "
                "(PREVIEW_MAX_BODY_BYTES): send fewer trajectory groups per training job."
            )
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            # NUL is allowed: a model can sample it (a byte-level token), and a trajectory must
            # arrive as sampled; services store it through jsonb_safe (U+FFFD in text columns).
            return strict_json.loads(raw.decode(encoding), allow_nul=True)
        except UnicodeDecodeError as exc:
            raise ParseError(
                f"The body is not valid {encoding} text (byte {exc.start}).", code="invalid_json"
            ) from None
        except strict_json.JSONError as exc:
            raise ParseError(f"The body is not valid JSON: {exc}", code="invalid_json") from None


# --- the protocol's shapes, for the OpenAPI schema (and DRF's OPTIONS) --------------------------
# The views read their bodies by hand and the services check each field (a 400 naming its place),
# as ART's client sends them; these serializers describe those bodies and the answers.


class RegisterIn(serializers.Serializer):
    entity = serializers.CharField(
        required=False,
        allow_null=True,
        help_text="the team's name; null (ART's first call) for the key's team",
    )
    project = serializers.CharField()
    name = serializers.CharField()
    base_model = serializers.CharField(help_text="a base model's name in the catalogue")
    return_existing = serializers.BooleanField(required=False, default=False)


class PreviewModelOut(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="model")
    entity = serializers.CharField(help_text="the team's name: wandb-artifact:///{entity}/{project}/{name}")
    project = serializers.CharField()
    name = serializers.CharField()
    base_model = serializers.CharField()
    run_id = serializers.CharField(allow_null=True, help_text="the model's client run")


class PreviewModelDeletedOut(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="model")
    deleted = serializers.BooleanField()


class PreviewCheckpointOut(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="checkpoint")
    step = serializers.IntegerField()
    metrics = serializers.DictField(child=serializers.FloatField())
    created_at = serializers.IntegerField(help_text="Unix seconds")


class CheckpointsDeleteIn(serializers.Serializer):
    steps = serializers.ListField(child=serializers.IntegerField(), help_text="never the latest step")


class CheckpointsDeletedOut(serializers.Serializer):
    deleted_count = serializers.IntegerField()
    not_found_steps = serializers.ListField(child=serializers.IntegerField())


class TrajectoryGroupsField(serializers.ListField):
    """ART's ``TrajectoryGroup`` objects as its client sends them (checked by the services)."""

    child = serializers.DictField()


class ModelLogIn(serializers.Serializer):
    model_id = serializers.CharField(required=False, help_text="ART's client repeats the URL's")
    trajectory_groups = TrajectoryGroupsField()
    split = serializers.CharField(help_text="e.g. val or train")


class ModelLogOut(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="model.log")
    split = serializers.CharField()
    step = serializers.IntegerField(help_text="the model's latest step when it was logged")
    trajectories = serializers.IntegerField()


class TrainingJobIn(serializers.Serializer):
    model_id = serializers.CharField(help_text="a model's id (a string of digits)")
    trajectory_groups = TrajectoryGroupsField()
    experimental_config = serializers.DictField(
        required=False, allow_null=True, help_text="ART's TrainConfig fields: learning_rate, loss settings"
    )


class TrainingJobOut(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="training_job")
    model_id = serializers.CharField()
    status = serializers.ChoiceField(choices=TrainingJobStatus.choices)
    step = serializers.IntegerField(allow_null=True, help_text="the checkpoint step it saved")
    error = serializers.CharField(allow_null=True)
    created_at = serializers.IntegerField(help_text="Unix seconds")


class TrainingJobEventOut(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="training_job.event")
    type = serializers.ChoiceField(choices=TrainingJobEventType.choices)
    data = serializers.DictField()  # type: ignore[assignment]  # the field, not Serializer.data
    message = serializers.CharField(allow_blank=True)
    created_at = serializers.IntegerField(help_text="Unix seconds")


@extend_schema_serializer(many=False)  # the list object itself, not an array of them
class PreviewCheckpointListOut(serializers.Serializer):
    """OpenAI's list object (projects.api.pagination.list_body) with ART's string ids."""

    object = serializers.CharField(default="list")
    data = PreviewCheckpointOut(many=True)  # type: ignore[assignment]  # the field, not Serializer.data
    has_more = serializers.BooleanField()
    first_id = serializers.CharField(allow_null=True)
    last_id = serializers.CharField(allow_null=True)


@extend_schema_serializer(many=False)
class TrainingJobEventListOut(PreviewCheckpointListOut):
    data = TrainingJobEventOut(many=True)  # type: ignore[assignment]


PAGE_PARAMETERS = [
    OpenApiParameter("after", int, description="id of the last item of the previous page"),
    OpenApiParameter("limit", int, description=f"items per page, 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT})"),
]


class BodyOnDelete(AutoSchema):
    """ART deletes checkpoints with a JSON body (``{steps}``); drf-spectacular documents request
    bodies on PUT, PATCH and POST only, so a DELETE's is built as a POST's would be."""

    def _get_request_body(self, direction: str = "request") -> Any:
        if self.method != "DELETE":
            return super()._get_request_body(direction)
        self.method = "POST"
        try:
            return super()._get_request_body(direction)
        finally:
            self.method = "DELETE"


class PreviewViewSet(TeamViewSet):
    parser_classes = [PreviewJSONParser]

    def body(self, *fields: str) -> dict[str, Any]:
        """The JSON object sent, with only ``fields`` (the keys ART's client sends): any other key
        is a 400 naming it, as on every /api/v1 write."""
        data = self.request.data
        if not isinstance(data, dict):
            raise ValidationFailed("the body must be a JSON object")
        refuse_unknown_fields(data, fields)
        return data

    def created_by(self) -> User | None:
        user = self.request.user
        return user if isinstance(user, User) else None


def _model_body(
    model: TrainableModel, run: Run | None, *, project: str | None = None, name: str | None = None
) -> dict[str, Any]:
    """``project`` and ``name``: as the client sent them (stored as their slugs, projects.client_names)."""
    return {
        "id": str(model.pk),
        "object": "model",
        "entity": model.project.team.name,
        "project": project or model.project.name,
        "name": name or model.name,
        "base_model": model.base_model.name,
        "run_id": str(run.pk) if run is not None else None,
    }


def _checkpoint_body(checkpoint: Checkpoint) -> dict[str, Any]:
    metrics = {
        key: float(value)
        for key, value in (checkpoint.metrics or {}).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    return {
        "id": str(checkpoint.pk),
        "object": "checkpoint",
        "step": checkpoint.step,
        "metrics": metrics,
        "created_at": int(checkpoint.created_at.timestamp()),
    }


def _event_body(event: TrainingJobEvent) -> dict[str, Any]:
    return {
        "id": str(event.pk),
        "object": "training_job.event",
        "type": event.type,
        "data": event.data,
        "message": event.message,
        "created_at": int(event.created_at.timestamp()),
    }


def _job_body(job: TrainingJob) -> dict[str, Any]:
    return {
        "id": str(job.pk),
        "object": "training_job",
        "model_id": str(job.model_id),
        "status": job.status,
        "step": job.step,
        "error": job.error or None,
        "created_at": int(job.created_at.timestamp()),
    }


class ModelsView(PreviewViewSet):
    """``POST /v1/preview/models`` (register, return existing) and ``DELETE /v1/preview/models/{id}``."""

    model = TrainableModel
    lookup_url_kwarg = "model_id"
    serializer_class = RegisterIn  # what OPTIONS describes

    def base_queryset(self) -> Any:
        return TrainableModel.objects.select_related("project__team", "base_model")

    @extend_schema(request=RegisterIn, responses={200: PreviewModelOut})
    def create(self, request: Request) -> Response:
        data = self.body("entity", "project", "name", "base_model", "return_existing")
        return_existing = data.get("return_existing", False)
        if not isinstance(return_existing, bool):
            raise ValidationFailed("must be a boolean", field="return_existing")
        model, run = services.client_model_register(
            team=self.team,
            entity=data.get("entity"),
            project=data.get("project"),  # type: ignore[arg-type]  # checked by the service
            name=data.get("name"),  # type: ignore[arg-type]
            base_model=data.get("base_model"),  # type: ignore[arg-type]
            return_existing=return_existing,
        )
        return Response(_model_body(model, run, project=data.get("project"), name=data.get("name")))

    @extend_schema(responses=PreviewModelOut)
    def retrieve(self, request: Request, model_id: int) -> Response:
        model = self.get_object()
        return Response(_model_body(model, selectors.client_run(model=model)))

    @extend_schema(responses={200: PreviewModelDeletedOut})
    def destroy(self, request: Request, model_id: int) -> Response:
        model = self.get_object()
        services.client_model_delete(model=model)
        return Response({"id": str(model_id), "object": "model", "deleted": True})


class CheckpointsView(PreviewViewSet):
    """``GET`` (cursor list, ``order=asc|desc`` by step) and ``DELETE`` (``{steps}``) of
    ``/v1/preview/models/{id}/checkpoints``."""

    model = TrainableModel
    lookup_url_kwarg = "model_id"
    schema = BodyOnDelete()

    @extend_schema(
        parameters=[
            OpenApiParameter("order", str, enum=["asc", "desc"], description="by step"),
            *PAGE_PARAMETERS,
        ],
        responses=PreviewCheckpointListOut,
    )
    def list(self, request: Request, model_id: int) -> Response:
        order = request.query_params.get("order", "asc")
        if order not in ("asc", "desc"):
            raise ValidationFailed("must be asc or desc", field="order")
        checkpoints = selectors.model_checkpoints(model=self.get_object(), descending=order == "desc")
        rows, has_more = page_of(checkpoints, request)
        return Response(list_body([_checkpoint_body(c) for c in rows], has_more=has_more))

    @extend_schema(request=CheckpointsDeleteIn, responses={200: CheckpointsDeletedOut})
    def remove(self, request: Request, model_id: int) -> Response:
        deleted, not_found = services.checkpoints_delete(
            model=self.get_object(), steps=self.body("steps").get("steps")
        )
        return Response({"deleted_count": deleted, "not_found_steps": not_found})


class ModelLogView(PreviewViewSet):
    """``POST /v1/preview/models/{id}/log`` ``{trajectory_groups, split}``: kept as sent."""

    model = TrainableModel
    lookup_url_kwarg = "model_id"
    serializer_class = ModelLogIn  # what OPTIONS describes

    @extend_schema(request=ModelLogIn, responses={200: ModelLogOut})
    def create(self, request: Request, model_id: int) -> Response:
        data = self.body("model_id", "trajectory_groups", "split")  # ART repeats the URL's model_id
        log = services.client_log_record(
            model=self.get_object(), split=data.get("split"), trajectory_groups=data.get("trajectory_groups")
        )
        body = {"id": str(log.pk), "object": "model.log", "split": log.split, "step": log.step,
                "trajectories": log.trajectory_count}  # fmt: skip
        return Response(body)


class TrainingJobsView(PreviewViewSet):
    """``POST /v1/preview/training-jobs`` ``{model_id, trajectory_groups, experimental_config}``
    → ``{id}``; ``GET /v1/preview/training-jobs/{id}``."""

    model = TrainingJob
    lookup_url_kwarg = "job_id"
    serializer_class = TrainingJobIn  # what OPTIONS describes

    @extend_schema(request=TrainingJobIn, responses={200: TrainingJobOut})
    def create(self, request: Request) -> Response:
        data = self.body("model_id", "trajectory_groups", "experimental_config")
        raw = data.get("model_id")
        model = None
        if (
            isinstance(raw, str | int)
            and not isinstance(raw, bool)
            and str(raw).isdecimal()
            and len(str(raw)) <= 18
        ):
            model = selectors.scoped(TrainableModel, self.team).filter(pk=int(raw)).first()
        if model is None:
            raise NotFound(f"no model with id {raw!r} in your team", field="model_id")
        job = services.training_job_create(
            model=model,
            trajectory_groups=data.get("trajectory_groups"),
            experimental_config=data.get("experimental_config"),
            created_by=self.created_by(),
        )
        return Response(_job_body(job))

    @extend_schema(responses=TrainingJobOut)
    def retrieve(self, request: Request, job_id: int) -> Response:
        return Response(_job_body(self.get_object()))


class TrainingJobEventsView(PreviewViewSet):
    """``GET /v1/preview/training-jobs/{id}/events?after=&limit=``, oldest first."""

    model = TrainingJob
    lookup_url_kwarg = "job_id"

    @extend_schema(parameters=PAGE_PARAMETERS, responses=TrainingJobEventListOut)
    def list(self, request: Request, job_id: int) -> Response:
        rows, has_more = page_of(selectors.training_job_events(job=self.get_object()), request)
        return Response(list_body([_event_body(event) for event in rows], has_more=has_more))
