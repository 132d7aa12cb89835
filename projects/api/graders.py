"""Grader endpoints, shaped like OpenAI's `POST /v1/fine_tuning/alpha/graders/{validate,run}`,
and the team's judge endpoints (their API key is write-only)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from projects import secrets
from projects.access import Permission
from projects.api.base import TeamViewSet
from projects.api.pagination import list_body
from projects.api.serializers import InputSerializer
from projects.api.views import _valid
from projects.errors import ValidationFailed
from projects.models import JudgeEndpoint
from projects.outbound import outbound_policy
from projects.services import grader_problems, judges
from projects.services.judges import API_KEY_MAX_CHARS
from training.rewards import GraderSetupError, Sample, build_grader, grade_group


class GraderValidateIn(InputSerializer):
    grader = serializers.JSONField()


class SampleIn(InputSerializer):
    output_text = serializers.CharField(allow_blank=True, trim_whitespace=False)
    messages = serializers.ListField(child=serializers.DictField(), required=False, default=list)
    output_tools = serializers.ListField(child=serializers.DictField(), required=False, default=list)


class GraderRunIn(InputSerializer):
    grader = serializers.JSONField()
    model_sample = serializers.JSONField(
        required=False, help_text="the model's output: a string or a sample object"
    )
    group = serializers.ListField(
        child=serializers.JSONField(), required=False, help_text="samples of one group (ruler)"
    )
    item = serializers.DictField(required=False, default=dict)
    judge_endpoint = serializers.CharField(
        max_length=63, required=False, help_text="name of a team judge endpoint"
    )


def _sample(value: Any, field: str) -> Sample:
    if isinstance(value, str):
        return Sample(output_text=value)
    serializer = SampleIn(data=value)
    if not serializer.is_valid():
        first_field, reasons = next(iter(serializer.errors.items()))
        raise ValidationFailed(str(reasons[0]), field=f"{field}.{first_field}")
    return Sample(**serializer.validated_data)


class GraderValidateView(TeamViewSet):
    serializer_class = GraderValidateIn  # what OPTIONS describes

    @extend_schema(request=GraderValidateIn, responses={200: dict})
    def create(self, request: Request) -> Response:
        data = _valid(GraderValidateIn, request.data)
        return Response({"grader": grader_problems(data["grader"], field="grader")})


class GraderRunView(TeamViewSet):
    """Grade one sample (or one group, for ruler) without starting a run: the reward editor's
    "try it" panel and CI checks of a grader."""

    serializer_class = GraderRunIn  # what OPTIONS describes

    @extend_schema(request=GraderRunIn, responses={200: dict})
    def create(self, request: Request) -> Response:
        data = _valid(GraderRunIn, request.data)
        spec = grader_problems(data["grader"], field="grader")
        if ("model_sample" in data) == ("group" in data):
            raise ValidationFailed("give exactly one of model_sample or group", field="model_sample")
        if "group" in data:
            if not data["group"]:
                raise ValidationFailed("must not be empty", field="group")
            samples = [_sample(value, f"group[{i}]") for i, value in enumerate(data["group"])]
        else:
            samples = [_sample(data["model_sample"], "model_sample")]
        judge = judges.judge_client(team=self.team, name=data.get("judge_endpoint"))
        try:
            grader = build_grader(
                spec,
                judge=judge,
                sandbox=judges.sandbox_config(team_id=self.team.pk, interactive=True),
                outbound=outbound_policy(),
            )
            results = grade_group(grader, samples, data["item"])
        except GraderSetupError as exc:
            raise ValidationFailed(str(exc), field="grader") from exc
        if "group" in data:
            return Response(list_body([result.to_openai_dict() for result in results]))
        return Response(results[0].to_openai_dict())


class JudgeEndpointOut(serializers.ModelSerializer):
    base_url = serializers.SerializerMethodField()
    has_api_key = serializers.SerializerMethodField()

    class Meta:
        model = JudgeEndpoint
        fields = ["id", "name", "base_url", "default_model", "timeout_s", "has_api_key", "created_at"]

    def get_base_url(self, obj: JudgeEndpoint) -> str:
        return secrets.url_public(obj.base_url)  # credentials stored before input refused them

    def get_has_api_key(self, obj: JudgeEndpoint) -> bool:
        return bool(obj.api_key_encrypted)


class JudgeEndpointIn(InputSerializer):
    name = serializers.CharField(max_length=63)
    base_url = serializers.CharField(max_length=500)
    api_key = serializers.CharField(
        max_length=API_KEY_MAX_CHARS, required=False, allow_blank=True, default="", write_only=True
    )
    default_model = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    timeout_s = serializers.FloatField(
        min_value=0.0, max_value=600.0, required=False, default=60.0, help_text="seconds, more than 0"
    )


class JudgeEndpointViewSet(TeamViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """OpenAI-compatible endpoints the team's LLM-judge graders call. The one named "default" is
    used by runs; the API key is stored encrypted and never returned. Owners write (the key is a
    team secret); changing ``base_url`` needs ``api_key`` again (``""`` for none)."""

    model = JudgeEndpoint
    serializer_class = JudgeEndpointOut
    write_permission = Permission.MANAGE

    @extend_schema(request=JudgeEndpointIn, responses={201: JudgeEndpointOut})
    def create(self, request: Request) -> Response:
        data = _valid(JudgeEndpointIn, request.data)
        endpoint = judges.judge_endpoint_create(team=self.team, **data)
        return Response(JudgeEndpointOut(endpoint).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=JudgeEndpointIn, responses=JudgeEndpointOut)
    def partial_update(self, request: Request, pk: str) -> Response:
        serializer = JudgeEndpointIn(data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        endpoint = judges.judge_endpoint_update(endpoint=self.get_object(), **serializer.validated_data)
        return Response(JudgeEndpointOut(endpoint).data)

    update = partial_update

    def destroy(self, request: Request, pk: str) -> Response:
        self.get_object().delete()
        return Response(status=status.HTTP_204_NO_CONTENT)
