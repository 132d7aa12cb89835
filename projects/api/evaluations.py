"""Evaluations over REST: ``POST /api/v1/evaluations`` queues a job (shaped like OpenAI's jobs: a
status, events, cancel) that evaluates a checkpoint or base model on a task set with a reward
definition, optionally against a reference; runs' own validation evaluations are listed the same way
(``GET /api/v1/evaluations?run=<id>`` or ``GET /api/v1/runs/<id>/evaluations``), and a
checkpoint's at ``GET /api/v1/checkpoints/<id>/evaluations``.

The subject is ``model`` (a model id as the gateway reads it: ``project/model:step``,
``project/model:latest`` or a base model name) or ``checkpoint`` (an id). ``reference`` is one of
``{"checkpoint": id}``, ``{"model": "<model id>"}`` or ``{"endpoint": <judge endpoint id>,
"model": "<name on that endpoint>"}``.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.api import serializers as s
from projects.api.base import TeamViewSet
from projects.api.pagination import int_query_param
from projects.api.views import _user, _valid
from projects.errors import ValidationFailed
from projects.models import (
    Checkpoint,
    Evaluation,
    EvaluationEvent,
    EvaluationSample,
    EvaluationStatus,
    Run,
)
from projects.services.evaluations import MAX_SAMPLES, MAX_SAMPLES_PER_ROW
from projects.services.fine_tuning import parse_id

# --- serializers ------------------------------------------------------------------------------


class ReferenceIn(s.InputSerializer):
    checkpoint = s.id_field(required=False, help_text="a checkpoint id")
    model = serializers.CharField(
        max_length=200,
        required=False,
        help_text="a model id (project/model:step, a base model name), or the model on `endpoint`",
    )
    endpoint = s.id_field(required=False, help_text="a team judge endpoint id (OpenAI-compatible)")


class EvaluationIn(s.InputSerializer):
    model = serializers.CharField(
        max_length=300,
        required=False,
        help_text="project/model:step, project/model:latest or a base model name",
    )
    checkpoint = s.id_field(required=False, help_text="a checkpoint id (instead of model)")
    fine_tuning_job = serializers.CharField(
        max_length=40,
        required=False,
        help_text="ftjob-<id>: evaluate a fine-tuning job — its newest checkpoint, its rows (held-out"
        " ones when it had a validation file), its environment and its grader, each unless given here",
    )
    task_set = s.id_field(required=False, help_text="required unless fine_tuning_job is given")
    split = serializers.CharField(
        max_length=16,
        required=False,
        default=None,
        help_text="validation, train or all (default: validation; a fine-tuning job without a"
        " validation file: all)",
    )
    environment = s.id_field(required=False, help_text="required unless fine_tuning_job is given")
    reward = s.id_field(
        required=False, help_text="a reward definition (version) id; required unless fine_tuning_job is given"
    )
    # The ranges services.evaluation_create checks (it names the field too).
    pass_threshold = serializers.FloatField(
        min_value=-1e9,
        max_value=1e9,
        required=False,
        allow_null=True,
        default=None,
        help_text="a sample passes at a reward at least this; default: the eval_pass_threshold of the"
        " run that made the checkpoint, else 1.0",
    )
    max_rows = serializers.IntegerField(
        min_value=1, max_value=MAX_SAMPLES, required=False, allow_null=True, default=None
    )
    samples_per_row = serializers.IntegerField(
        min_value=1, max_value=MAX_SAMPLES_PER_ROW, required=False, default=1
    )
    temperature = serializers.FloatField(min_value=0.0, max_value=2.0, required=False, default=0.0)
    max_new_tokens = serializers.IntegerField(
        min_value=1, max_value=4096, required=False, allow_null=True, default=None
    )
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False, default=0)
    reference = ReferenceIn(required=False, allow_null=True, default=None)


class EvaluationOut(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField()
    reference = serializers.SerializerMethodField()

    class Meta:
        model = Evaluation
        fields = [
            "id", "object", "project", "run", "step", "checkpoint", "model", "task_set", "split",
            "environment", "reward", "pass_threshold", "max_rows", "samples_per_row", "config",
            "reference", "status", "error", "results", "created_at", "started_at", "finished_at",
        ]  # fmt: skip

    def get_object(self, obj: Evaluation) -> str:
        return "evaluation"

    def get_model(self, obj: Evaluation) -> str:
        """The evaluated model's id (``project/model:step`` or the base model name)."""
        return selectors.model_label(obj.checkpoint, obj.base_model)

    def get_reference(self, obj: Evaluation) -> dict[str, Any] | None:
        return selectors.evaluation_reference(obj)


class EvaluationSampleOut(serializers.ModelSerializer):
    class Meta:
        model = EvaluationSample
        fields = [
            "id", "side", "task_row_index", "sample_index", "messages", "reward", "sub_rewards", "errors", "metrics",
        ]  # fmt: skip


class EvaluationEventOut(serializers.ModelSerializer):
    object = serializers.SerializerMethodField()

    class Meta:
        model = EvaluationEvent
        fields = ["id", "object", "created_at", "level", "message", "data"]

    def get_object(self, obj: EvaluationEvent) -> str:
        return "evaluation.event"


# --- views ------------------------------------------------------------------------------------


def _reference(data: dict[str, Any] | None) -> selectors.ModelChoice | None:
    """The request's ``reference`` object as a model choice: with an ``endpoint``, ``model`` is the
    model to call there; without, a model id (``selectors.evaluation_inputs_resolve`` checks it)."""
    if not data:
        return None
    if data.get("endpoint") not in (None, ""):
        return selectors.ModelChoice(
            endpoint=data["endpoint"],
            checkpoint=data.get("checkpoint"),
            endpoint_model=data.get("model") or "",
        )
    return selectors.ModelChoice(checkpoint=data.get("checkpoint"), model_id=data.get("model"))


def _with_job_defaults(team: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with what a ``fine_tuning_job`` fills in where the request left it out (a golden
    comparison: the job's checkpoint against the model it replaces, same rows, same grader); without
    one, task_set, environment and reward are required."""
    job_id = data.get("fine_tuning_job")
    if job_id:
        number = parse_id(job_id, "ftjob")
        run = None if number is None else selectors.fine_tuning_job_run(team=team, number=number)
        if run is None:
            raise ValidationFailed(
                f"no fine-tuning job of this team has the id '{job_id}'", field="fine_tuning_job"
            )
        defaults = selectors.run_evaluation_inputs(run=run)
        if data.get("model") in (None, "") and data.get("checkpoint") is None:
            if defaults["checkpoint"] is None:
                raise ValidationFailed(
                    "the job has trained no step yet: name a model or checkpoint to evaluate",
                    field="fine_tuning_job",
                )
            data["checkpoint"] = defaults["checkpoint"]
        for name in ("task_set", "environment", "reward", "split"):
            if data.get(name) is None:
                data[name] = defaults[name]
    for name in ("task_set", "environment", "reward"):
        if data.get(name) is None:
            raise ValidationFailed("this field is required (or give fine_tuning_job)", field=name)
    if data.get("split") is None:
        data["split"] = "validation"
    return data


class EvaluationViewSet(TeamViewSet, mixins.RetrieveModelMixin):
    model = Evaluation
    serializer_class = EvaluationOut

    def base_queryset(self) -> Any:
        return Evaluation.objects.select_related(
            "checkpoint__model__project",
            "base_model",
            "reference_checkpoint__model__project",
            "reference_base_model",
        )

    @extend_schema(
        parameters=[
            OpenApiParameter("project", int),
            OpenApiParameter("run", int),
            OpenApiParameter("checkpoint", int),
            OpenApiParameter("status", str),
        ]
    )
    def list(self, request: Request) -> Response:
        queryset = self.filter_by_project(self.get_queryset())
        if (run := int_query_param(request, "run", None)) is not None:
            queryset = queryset.filter(run_id=run)
        if (checkpoint := int_query_param(request, "checkpoint", None)) is not None:
            queryset = queryset.filter(checkpoint_id=checkpoint)
        if evaluation_status := request.query_params.get("status"):
            if evaluation_status not in EvaluationStatus.values:
                raise ValidationFailed(f"must be one of {', '.join(EvaluationStatus.values)}", field="status")
            queryset = queryset.filter(status=evaluation_status)
        return self.paginated(queryset.order_by("-id"), EvaluationOut)

    @extend_schema(request=EvaluationIn, responses={201: EvaluationOut})
    def create(self, request: Request) -> Response:
        data = _valid(EvaluationIn, request.data)
        data = _with_job_defaults(self.team, data)
        inputs = selectors.evaluation_inputs_resolve(
            team=self.team,
            subject=selectors.ModelChoice(checkpoint=data.get("checkpoint"), model_id=data.get("model")),
            task_set=data["task_set"],
            environment=data["environment"],
            reward=data["reward"],
            reference=_reference(data["reference"]),
        )
        evaluation = services.evaluation_create(
            **inputs,
            **{name: data[name] for name in services.EVALUATION_SETTINGS},
            created_by=_user(request),
        )
        return Response(EvaluationOut(evaluation).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=EvaluationOut)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        _valid(s.NoBodyIn, request.data)
        evaluation = services.evaluation_cancel(evaluation=self.get_object())
        return Response(EvaluationOut(evaluation).data)

    @extend_schema(responses=EvaluationSampleOut(many=True), parameters=[OpenApiParameter("side", str)])
    @action(detail=True, methods=["get"])
    def samples(self, request: Request, pk: str) -> Response:
        side = request.query_params.get("side")
        if side not in (None, "", "subject", "reference"):
            raise ValidationFailed("must be subject or reference", field="side")
        samples = selectors.evaluation_samples(evaluation=self.get_object(), side=side)
        return self.paginated(samples, EvaluationSampleOut)

    @extend_schema(
        responses=EvaluationEventOut(many=True),
        parameters=[OpenApiParameter("after", int), OpenApiParameter("limit", int)],
    )
    @action(detail=True, methods=["get"])
    def events(self, request: Request, pk: str) -> Response:
        """Events after the id ``after`` (``0`` from the start, then the last id you saw), oldest first."""
        return self.paginated(self.get_object().events.order_by("id"), EvaluationEventOut)


class RunEvaluationsView(TeamViewSet):
    """``GET /api/v1/runs/<id>/evaluations``: the run's validation evaluations, by step."""

    model = Run
    lookup_url_kwarg = "run_id"

    @extend_schema(responses=EvaluationOut(many=True))
    def list(self, request: Request, run_id: int) -> Response:
        run = self.get_object()
        queryset = selectors.evaluations_list(team=self.team, run_id=run.pk).order_by("step", "id")
        return self.paginated(queryset, EvaluationOut)


class CheckpointEvaluationsView(TeamViewSet):
    """``GET /api/v1/checkpoints/<id>/evaluations``: every evaluation of one checkpoint (a run's at
    its step, and requested ones), newest first."""

    model = Checkpoint
    lookup_url_kwarg = "checkpoint_id"

    @extend_schema(responses=EvaluationOut(many=True))
    def list(self, request: Request, checkpoint_id: int) -> Response:
        checkpoint = self.get_object()
        queryset = selectors.evaluations_list(team=self.team, checkpoint_id=checkpoint.pk)
        return self.paginated(queryset, EvaluationOut)
