"""``GET /api/v1/costs``: what the team's runs and evaluations used and cost, by day, model or run.

Usage is summed over the steps of the caller's team's runs and client training jobs
(``TeamViewSet`` over ``StepMetrics``) and over its evaluations' results, in-run and standalone
(``projects.selectors.costs``): device-seconds by kind (the
worker's wall clock × the devices it held), tokens sampled and trained, judge tokens. ``cost`` is
``null`` when the operator set no price (``PRICE_PER_*`` settings), never a made-up 0. One run's
totals are also ``GET /api/v1/runs/{id}/cost`` (``RunViewSet.cost``). Gateway tokens used by
inference requests are ``GET /api/v1/usage``.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors
from projects.api.base import TeamViewSet
from projects.api.pagination import group_by_fields, list_body
from projects.models import Evaluation, Run, StepMetrics, TrainableModel
from projects.selectors.costs import GROUPS


class CostQuery(serializers.Serializer):
    start = serializers.DateField(required=False, help_text="first day (UTC), inclusive")
    end = serializers.DateField(required=False, help_text="last day (UTC), inclusive")
    run = serializers.IntegerField(required=False, help_text="only this run's steps")
    model = serializers.IntegerField(required=False, help_text="only the runs of this trainable model (id)")
    group_by = serializers.CharField(
        max_length=100, required=False, default="day", help_text="day, model, run"
    )

    def validate_group_by(self, value: str) -> list[str]:
        return group_by_fields(value, GROUPS)

    def validate(self, attrs: dict) -> dict:
        if "start" in attrs and "end" in attrs and attrs["start"] > attrs["end"]:
            raise serializers.ValidationError({"end": "must not be before start"})
        return attrs


class CostPartsOut(serializers.Serializer):
    currency = serializers.CharField()
    gpu = serializers.FloatField(allow_null=True, help_text="null: used but not priced")
    cpu = serializers.FloatField(allow_null=True)
    tokens = serializers.FloatField(allow_null=True, help_text="tokens sampled + trained")
    judge_tokens = serializers.FloatField(allow_null=True)
    total = serializers.FloatField(help_text="the priced parts' sum (not_priced names the rest)")
    not_priced = serializers.ListField(child=serializers.CharField())


class CostOut(serializers.Serializer):
    day = serializers.DateField(required=False)
    model = serializers.CharField(required=False, allow_null=True, help_text="project/model")
    model_id = serializers.IntegerField(
        required=False, allow_null=True, help_text="null: a base model's evaluation"
    )
    run = serializers.IntegerField(required=False, allow_null=True, help_text="null: standalone evaluations")
    steps = serializers.IntegerField(help_text="training steps counted")
    evaluations = serializers.IntegerField(help_text="evaluations counted (in-run and standalone)")
    gpu_seconds = serializers.FloatField()
    cpu_seconds = serializers.FloatField()
    gpu_hours = serializers.FloatField()
    cpu_hours = serializers.FloatField()
    device_hours = serializers.FloatField()
    sampled_tokens = serializers.IntegerField()
    trained_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField(help_text="sampled + trained")
    judge_prompt_tokens = serializers.IntegerField()
    judge_completion_tokens = serializers.IntegerField()
    judge_tokens = serializers.IntegerField()
    cost = CostPartsOut(allow_null=True, help_text="null when the operator set no price")


class RunCostOut(CostOut):
    object = serializers.CharField(help_text='"run.cost"')


class CostViewSet(TeamViewSet):
    model = StepMetrics

    @extend_schema(
        parameters=[
            OpenApiParameter("start", str), OpenApiParameter("end", str),
            OpenApiParameter("run", int), OpenApiParameter("model", int),
            OpenApiParameter("group_by", str, description="comma-separated: day, model, run (default day)"),
        ],
        responses=CostOut(many=True),
    )  # fmt: skip
    def list(self, request: Request) -> Response:
        given = CostQuery(data=request.query_params)
        given.is_valid(raise_exception=True)
        query = dict(given.validated_data)
        steps = self.get_queryset()
        evaluations = selectors.scoped(Evaluation, self.team)  # the same team's, through its TEAM_PATH
        if "run" in query:
            run = self.ref(Run, query["run"], "run")
            steps, evaluations = steps.filter(run=run), evaluations.filter(run=run)
        if "model" in query:
            model = self.ref(TrainableModel, query["model"], "model")
            steps, evaluations = steps.filter(run__model=model), evaluations.filter(checkpoint__model=model)
        rows = selectors.cost_rows(
            steps, evaluations, group_by=query["group_by"], start=query.get("start"), end=query.get("end")
        )
        data = list(CostOut(rows, many=True).data)
        totals = CostOut(selectors.rows_total(rows)).data
        return Response(list_body(data, group_by=query["group_by"], totals=totals))
