"""REST API views. Each action: one input serializer, one service call, one output serializer.

Tenancy is enforced once, in ``projects.api.base``: every view here derives from ``TeamViewSet``
(or ``CatalogueViewSet`` for the shared base-model catalogue) and provides ``base_queryset()``.

Why one module of this length: one thin viewset per REST resource, each an input serializer, a
service call and an output serializer.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db.models import Max, QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from projects import catalog, selectors, services
from projects.access import Permission
from projects.api import serializers as s
from projects.api.base import CatalogueViewSet, TeamViewSet
from projects.api.costs import RunCostOut
from projects.api.pagination import int_query_param, list_body
from projects.errors import ValidationFailed
from projects.models import (
    ApiKey,
    BaseModel,
    Checkpoint,
    Environment,
    Membership,
    Project,
    RewardDefinition,
    Run,
    RunStatus,
    TaskSet,
    TrainableModel,
)
from training import names


def upload_text(upload: Any) -> str:
    """An uploaded task file (a task set's, a fine-tuning file's) as text: a 400 on ``file`` when
    it is over MAX_TASKSET_BYTES or not UTF-8."""
    from django.conf import settings

    if upload.size > settings.MAX_TASKSET_BYTES:
        raise ValidationFailed(f"larger than {settings.MAX_TASKSET_BYTES} bytes", field="file")
    try:
        return str(upload.read().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValidationFailed(f"not UTF-8 text (byte {exc.start})", field="file") from exc


def _valid(serializer_class: type, data: Any, partial: bool = False) -> dict[str, Any]:
    serializer = serializer_class(data=data, partial=partial)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


class ProjectViewSet(TeamViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    model = Project
    serializer_class = s.ProjectOut

    @extend_schema(request=s.ProjectIn, responses={201: s.ProjectOut})
    def create(self, request: Request) -> Response:
        data = _valid(s.ProjectIn, request.data)
        project = services.project_create(team=self.team, **data)
        return Response(s.ProjectOut(project).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.ProjectUpdateIn, responses=s.ProjectOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _valid(s.ProjectUpdateIn, request.data)
        project = services.project_update(project=self.get_object(), **data)
        return Response(s.ProjectOut(project).data)

    update = partial_update

    def destroy(self, request: Request, pk: str) -> Response:
        services.project_delete(project=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class BaseModelViewSet(CatalogueViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The operator-maintained catalogue of base models (readable by every team)."""

    model = BaseModel
    serializer_class = s.BaseModelOut

    def list(self, request: Request) -> Response:
        return self.paginated(self.get_queryset().order_by("name"), s.BaseModelOut)


class TrainableModelViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    model = TrainableModel
    serializer_class = s.TrainableModelOut

    def base_queryset(self) -> QuerySet:
        return TrainableModel.objects.select_related("base_model")

    @extend_schema(parameters=[OpenApiParameter("project", int)])
    def list(self, request: Request) -> Response:
        return self.paginated(self.filter_by_project(self.get_queryset()), s.TrainableModelOut)

    @extend_schema(request=s.TrainableModelIn, responses={201: s.TrainableModelOut})
    def create(self, request: Request) -> Response:
        data = _valid(s.TrainableModelIn, request.data)
        project = self.ref(Project, data["project"], "project")
        base_model = BaseModel.objects.filter(name=data["base_model"]).first()
        if base_model is None:
            known = BaseModel.objects.values_list("name", flat=True)
            raise ValidationFailed(names.unknown("base model", data["base_model"], known), field="base_model")
        model = services.trainable_model_create(
            project=project,
            name=data["name"],
            base_model=base_model,
            lora=data["lora"],
            devices=data["devices"],
            fsdp=data["fsdp"],
        )
        return Response(s.TrainableModelOut(model).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.TrainableModelUpdateIn, responses=s.TrainableModelOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _valid(s.TrainableModelUpdateIn, request.data)
        model = services.trainable_model_update(model=self.get_object(), **data)
        return Response(s.TrainableModelOut(model).data)

    update = partial_update

    def destroy(self, request: Request, pk: str) -> Response:
        services.trainable_model_delete(model=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=s.AdapterImportIn, responses={201: s.CheckpointOut})
    @action(detail=True, methods=["post"])
    def adapter(self, request: Request, pk: str) -> Response:
        """Import a LoRA adapter trained elsewhere (a PEFT folder as a .zip or .tar.gz ``file``) as
        the model's step 0: checked against the base model, then trained on by runs and served by
        the gateway like any checkpoint. 409 on a model that has checkpoints."""
        model = self.get_object()
        upload = _valid(s.AdapterImportIn, request.data)["file"]
        if upload.size > settings.MAX_ADAPTER_BYTES:
            raise ValidationFailed(f"larger than {settings.MAX_ADAPTER_BYTES} bytes", field="file")
        checkpoint = services.model_adapter_import(model=model, archive=upload.read())
        return Response(s.CheckpointOut(checkpoint).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=s.CheckpointOut(many=True))
    @action(detail=True, methods=["get"])
    def checkpoints(self, request: Request, pk: str) -> Response:
        checkpoints = Checkpoint.objects.filter(model=self.get_object()).select_related("model__project")
        return self.paginated(checkpoints.order_by("step"), s.CheckpointOut)


class RewardDefinitionViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    """Versioned grader specs: an update inserts the next version and returns it (201)."""

    model = RewardDefinition
    serializer_class = s.RewardDefinitionOut

    @extend_schema(
        parameters=[
            OpenApiParameter("project", int),
            OpenApiParameter("name", str),
            OpenApiParameter("latest", bool, description="only the newest version of each name"),
        ]
    )
    def list(self, request: Request) -> Response:
        queryset = self.filter_by_project(self.get_queryset())
        if name := request.query_params.get("name"):
            queryset = queryset.filter(name=name)
        if request.query_params.get("latest") in {"1", "true"}:
            newest = queryset.values("project", "name").annotate(v=Max("version"))
            ids = [
                queryset.filter(project=row["project"], name=row["name"], version=row["v"]).values_list(
                    "id", flat=True
                )[0]
                for row in newest
            ]
            queryset = queryset.filter(id__in=ids)
        return self.paginated(queryset, s.RewardDefinitionOut)

    @extend_schema(request=s.RewardDefinitionIn, responses={201: s.RewardDefinitionOut})
    def create(self, request: Request) -> Response:
        data = _valid(s.RewardDefinitionIn, request.data)
        project = self.ref(Project, data["project"], "project")
        definition = services.reward_definition_create(project=project, name=data["name"], spec=data["spec"])
        return Response(s.RewardDefinitionOut(definition).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.RewardDefinitionUpdateIn, responses={201: s.RewardDefinitionOut})
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _valid(s.RewardDefinitionUpdateIn, request.data)
        definition = services.reward_definition_update(definition=self.get_object(), spec=data["spec"])
        return Response(s.RewardDefinitionOut(definition).data, status=status.HTTP_201_CREATED)

    update = partial_update

    def destroy(self, request: Request, pk: str) -> Response:
        services.reward_definition_delete(definition=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses=s.RewardDefinitionOut(many=True))
    @action(detail=True, methods=["get"])
    def versions(self, request: Request, pk: str) -> Response:
        definition = self.get_object()
        versions = (
            self.get_queryset().filter(project=definition.project, name=definition.name).order_by("version")
        )
        return self.paginated(versions, s.RewardDefinitionOut)


class TaskSetViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    model = TaskSet
    serializer_class = s.TaskSetOut

    @extend_schema(parameters=[OpenApiParameter("project", int)])
    def list(self, request: Request) -> Response:
        return self.paginated(self.filter_by_project(self.get_queryset()), s.TaskSetOut)

    @extend_schema(request=s.TaskSetIn, responses={201: s.TaskSetOut})
    def create(self, request: Request) -> Response:
        """Upload rows as JSON (``rows``), as JSONL text (``jsonl``) or as a multipart ``file``."""
        data = _valid(s.TaskSetIn, request.data)
        project = self.ref(Project, data["project"], "project")
        jsonl = data.get("jsonl")
        if upload := data.get("file"):
            jsonl = upload_text(upload)
        task_set = services.task_set_create(
            project=project,
            name=data["name"],
            jsonl=jsonl,
            rows=data.get("rows") if jsonl is None else None,
            validation_fraction=data["validation_fraction"],
            seed=data["seed"],
        )
        return Response(s.TaskSetOut(task_set).data, status=status.HTTP_201_CREATED)

    def destroy(self, request: Request, pk: str) -> Response:
        services.task_set_delete(task_set=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(responses=s.TaskRowOut(many=True), parameters=[OpenApiParameter("split", str)])
    @action(detail=True, methods=["get"])
    def rows(self, request: Request, pk: str) -> Response:
        rows = self.get_object().rows.order_by("index")
        if split := request.query_params.get("split"):
            rows = rows.filter(split=split)
        return self.paginated(rows, s.TaskRowOut)


class EnvironmentViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    model = Environment
    serializer_class = s.EnvironmentOut

    @extend_schema(parameters=[OpenApiParameter("project", int)])
    def list(self, request: Request) -> Response:
        return self.paginated(self.filter_by_project(self.get_queryset()), s.EnvironmentOut)

    @extend_schema(request=s.EnvironmentIn, responses={201: s.EnvironmentOut})
    def create(self, request: Request) -> Response:
        data = _valid(s.EnvironmentIn, request.data)
        project = self.ref(Project, data.pop("project"), "project")
        environment = services.environment_create(project=project, **data)
        return Response(s.EnvironmentOut(environment).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.EnvironmentUpdateIn, responses=s.EnvironmentOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _valid(s.EnvironmentUpdateIn, request.data)
        environment = services.environment_update(environment=self.get_object(), **data)
        return Response(s.EnvironmentOut(environment).data)

    update = partial_update

    def destroy(self, request: Request, pk: str) -> Response:
        services.environment_delete(environment=self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class RunViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    """Training runs (shaped like OpenAI fine-tuning jobs: events, checkpoints, cancel, pause,
    resume), and fork."""

    model = Run
    serializer_class = s.RunOut

    @extend_schema(parameters=[OpenApiParameter("project", int), OpenApiParameter("status", str)])
    def list(self, request: Request) -> Response:
        queryset = self.filter_by_project(self.get_queryset())
        if run_status := request.query_params.get("status"):
            if run_status not in RunStatus.values:
                raise ValidationFailed(f"must be one of {', '.join(RunStatus.values)}", field="status")
            queryset = queryset.filter(status=run_status)
        return self.paginated(queryset, s.RunOut)

    @extend_schema(request=s.RunIn, responses={201: s.RunOut})
    def create(self, request: Request) -> Response:
        data = _valid(s.RunIn, request.data)
        run = services.run_create(
            model=self.ref(TrainableModel, data["model"], "model"),
            task_set=self.ref(TaskSet, data["task_set"], "task_set"),
            environment=self.ref(Environment, data["environment"], "environment"),
            reward=self.ref(RewardDefinition, data["reward"], "reward"),
            config=data["config"],
            created_by=_user(request),
            start_from=data.get("start_from", services.START_FROM_LATEST),
            kind=data["kind"],
        )
        return Response(s.RunOut(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=s.RunOut)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        _valid(s.NoBodyIn, request.data)
        run = services.run_cancel(run=self.get_object())
        return Response(s.RunOut(run).data)

    @extend_schema(request=None, responses=s.RunOut)
    @action(detail=True, methods=["post"])
    def pause(self, request: Request, pk: str) -> Response:
        """A running run pauses after its current step (its worker is released); a queued one at
        once. 409 for a finished, paused or cancelling run."""
        _valid(s.NoBodyIn, request.data)
        run = services.run_pause(run=self.get_object())
        return Response(s.RunOut(run).data)

    @extend_schema(request=None, responses=s.RunOut)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        """A paused run is queued again and continues from its last checkpoint. 409 otherwise."""
        _valid(s.NoBodyIn, request.data)
        run = services.run_resume(run=self.get_object())
        return Response(s.RunOut(run).data)

    @extend_schema(request=s.RunForkIn, responses={201: s.RunOut})
    @action(detail=True, methods=["post"])
    def fork(self, request: Request, pk: str) -> Response:
        """A new model whose step 0 is a copy of checkpoint ``from_step`` of this run's model, and
        a new run on it (this run's inputs and config, ``config`` overriding); returns the new run."""
        source = self.get_object()
        data = _valid(s.RunForkIn, request.data)
        run = services.run_fork(
            run=source,
            from_step=data["from_step"],
            name=data["name"],
            config=data["config"],
            created_by=_user(request),
        )
        return Response(s.RunOut(run).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        responses=s.RunEventOut(many=True),
        parameters=[OpenApiParameter("after", int), OpenApiParameter("limit", int)],
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str) -> Response:
        """Events after the id ``after`` (``0`` from the start, then the last id you saw), oldest first."""
        return self.paginated(self.get_object().events.order_by("id"), s.RunEventOut)

    @extend_schema(responses=RunCostOut)
    @action(detail=True, methods=["get"])
    def cost(self, request: Request, pk: str) -> Response:
        """What the run used and cost over all its steps (projects.api.costs has the fields)."""
        return Response(RunCostOut(selectors.run_cost(run=self.get_object())).data)

    @extend_schema(responses=s.StepMetricsOut(many=True))
    @action(detail=True, methods=["get"])
    def metrics(self, request: Request, pk: str) -> Response:
        metrics = selectors.run_step_metrics(run=self.get_object())
        return self.paginated(metrics, s.StepMetricsOut)

    @extend_schema(responses=s.CheckpointOut(many=True))
    @action(detail=True, methods=["get"])
    def checkpoints(self, request: Request, pk: str) -> Response:
        checkpoints = selectors.run_checkpoints(run=self.get_object()).select_related("model__project")
        return self.paginated(checkpoints, s.CheckpointOut)

    @extend_schema(responses=s.TrajectoryOut(many=True), parameters=[OpenApiParameter("step", int)])
    @action(detail=True, methods=["get"])
    def trajectories(self, request: Request, pk: str) -> Response:
        """The run's trajectories; each one's ``metrics`` carries what the update made of it:
        ``length_penalty``, ``advantage`` and ``trained`` (the values the trainer stored with the
        step, or for older rows the same computation again: selectors.trajectory_update_signals)."""
        run = self.get_object()
        trajectories = selectors.run_trajectories(run=run, step=int_query_param(request, "step", None))
        page = list(self.paginate_queryset(trajectories) or [])
        signals = selectors.trajectory_page_update_signals(run=run, page=page)
        for row in page:
            signal = signals[row.pk]
            row.metrics = {
                **row.metrics,
                "length_penalty": signal.length_penalty,
                "advantage": signal.advantage,
                "trained": signal.trained,
            }
        return self.get_paginated_response(s.TrajectoryOut(page, many=True).data)


def _user(request: Request) -> User | None:
    """The signed-in person, or None for API-key requests (keys belong to teams)."""
    return request.user if isinstance(request.user, User) else None


class ApiKeyViewSet(TeamViewSet, mixins.ListModelMixin):
    """Team API keys. Owners create and revoke; the plaintext key is returned once, at creation."""

    model = ApiKey
    serializer_class = s.ApiKeyOut
    write_permission = Permission.MANAGE

    @extend_schema(request=s.ApiKeyIn, responses={201: s.ApiKeyOut})
    def create(self, request: Request) -> Response:
        data = _valid(s.ApiKeyIn, request.data)
        created = services.api_key_create(
            team=self.team,
            name=data["name"],
            read_only=data["read_only"],
            created_by=_user(request),
        )
        if data["completion_storage"]:
            services.api_key_storage_set(api_key=created.api_key, storage=data["completion_storage"])
        body = dict(s.ApiKeyOut(created.api_key).data)
        body["key"] = created.plaintext
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=s.ApiKeyUpdateIn, responses=s.ApiKeyOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        data = _valid(s.ApiKeyUpdateIn, request.data)
        api_key = services.api_key_storage_set(api_key=self.get_object(), storage=data["completion_storage"])
        return Response(s.ApiKeyOut(api_key).data)

    @extend_schema(request=None, responses=s.ApiKeyOut)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str) -> Response:
        _valid(s.NoBodyIn, request.data)
        api_key = services.api_key_revoke(api_key=self.get_object())
        return Response(s.ApiKeyOut(api_key).data)


class MemberViewSet(TeamViewSet, mixins.ListModelMixin):
    """The team's members and their roles. Any member reads; owners change roles and remove members
    (session sign-in: API keys belong to teams, not people, so none is an owner). Nobody is added
    here: people join by accepting an invitation (``/api/v1/invitations/``). A team keeps at least
    one owner: demoting or removing the last one is a 400 ``last_owner``."""

    model = Membership
    serializer_class = s.MemberOut
    write_permission = Permission.MANAGE

    def base_queryset(self) -> QuerySet:
        return Membership.objects.select_related("user").order_by("user__username")

    @extend_schema(request=s.MemberRoleIn, responses=s.MemberOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        membership = self.get_object()
        data = _valid(s.MemberRoleIn, request.data)
        membership = services.membership_set(
            team=self.team, user=membership.user, role=data["role"], by=_user(request)
        )
        return Response(s.MemberOut(membership).data)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request: Request, pk: str) -> Response:
        membership = self.get_object()
        services.membership_remove(team=self.team, user=membership.user, by=_user(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class EnvironmentKindsView(CatalogueViewSet):
    """Every environment kind with its tools, config keys and how its final answer is read (the
    environment form reads these)."""

    @extend_schema(responses={200: s.EnvironmentKindOut(many=True)})
    def list(self, request: Request) -> Response:
        return Response(list_body(list(s.EnvironmentKindOut(catalog.environment_kinds(), many=True).data)))


class HyperparametersView(CatalogueViewSet):
    """Defaults and help text of every run hyperparameter (the run form reads these)."""

    @extend_schema(responses={200: dict})
    def list(self, request: Request) -> Response:
        return Response(catalog.hyperparameters())
