"""``GET /api/v1/usage``: tokens used through the gateway, by day and by model (and API key).

Rows are the caller's team's only (``TeamViewSet``). Totals are sums over the matching
``UsageRecord`` rows, grouped by the fields named in ``group_by``.
"""

from __future__ import annotations

from django.db.models import Sum
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from projects.api.base import TeamViewSet
from projects.api.pagination import group_by_fields, list_body
from projects.api.views import _valid
from projects.models import UsageRecord

GROUPS = {"day": "day", "model": "model", "api_key": "api_key__prefix"}


class UsageQuery(serializers.Serializer):
    start = serializers.DateField(required=False, help_text="first day (UTC), inclusive")
    end = serializers.DateField(required=False, help_text="last day (UTC), inclusive")
    model = serializers.CharField(
        max_length=300, required=False, help_text="only this model id, e.g. project/model:3"
    )
    group_by = serializers.CharField(
        max_length=100, required=False, default="day,model", help_text="day, model, api_key"
    )

    def validate_group_by(self, value: str) -> list[str]:
        return group_by_fields(value, GROUPS)


class UsageOut(serializers.Serializer):
    day = serializers.DateField(required=False)
    model = serializers.CharField(required=False)
    api_key = serializers.CharField(required=False, help_text="the key's public prefix")
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class UsageViewSet(TeamViewSet):
    model = UsageRecord

    @extend_schema(
        parameters=[
            OpenApiParameter("start", str), OpenApiParameter("end", str), OpenApiParameter("model", str),
            OpenApiParameter("group_by", str, description="comma-separated: day, model, api_key"),
        ],
        responses=UsageOut(many=True),
    )  # fmt: skip
    def list(self, request: Request) -> Response:
        query = _valid(UsageQuery, request.query_params)
        records = self.get_queryset()
        if "start" in query:
            records = records.filter(day__gte=query["start"])
        if "end" in query:
            records = records.filter(day__lte=query["end"])
        if "model" in query:
            records = records.filter(model=query["model"])
        groups = query["group_by"]
        columns = [GROUPS[group] for group in groups]
        sums = {"requests": Sum("requests"), "prompt_tokens": Sum("prompt_tokens"),
                "completion_tokens": Sum("completion_tokens")}  # fmt: skip
        rows = (
            records.values(*columns).annotate(**sums).order_by(*columns)
            if columns
            else [records.aggregate(**sums)]
        )
        data = []
        for row in rows:
            item = {group: row[GROUPS[group]] for group in groups}
            item.update({key: row[key] or 0 for key in sums})
            item["total_tokens"] = item["prompt_tokens"] + item["completion_tokens"]
            data.append(item)
        totals = {key: sum(item[key] for item in data) for key in [*sums, "total_tokens"]}
        return Response(list_body(list(UsageOut(data, many=True).data), group_by=groups, totals=totals))
