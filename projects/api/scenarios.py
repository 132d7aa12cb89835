"""``POST /api/v1/task-sets/generate``: scenario generation (see projects.services.scenarios). Synchronous,
bounded to 100 rows and two minutes; returns the new task set with its generation report."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from projects.api import serializers as s
from projects.api.base import TeamViewSet
from projects.api.views import _valid
from projects.models import Environment, JudgeEndpoint, Project
from projects.services import scenarios
from training.rollouts.scenarios import MAX_ROWS


class GenerateIn(s.InputSerializer):
    project = s.id_field()
    environment = s.id_field(help_text="the environment whose tools the tasks use")
    endpoint = s.id_field(help_text="a team judge endpoint id (any OpenAI-compatible endpoint)")
    model = serializers.CharField(
        max_length=200, required=False, allow_blank=True, default="", help_text="default: the endpoint's"
    )
    n = serializers.IntegerField(
        min_value=1, max_value=MAX_ROWS, help_text=f"rows to generate, 1 to {MAX_ROWS}"
    )
    instruction = serializers.CharField(
        max_length=scenarios.MAX_INSTRUCTION_CHARS, help_text="what the tasks should be about"
    )
    name = serializers.CharField(max_length=63, help_text="name of the new task set")
    validation_fraction = s.fraction_field(required=False, default=0.0)
    seed = s.seed_field(required=False, default=0)


class GeneratedTaskSetOut(s.TaskSetOut):
    class Meta(s.TaskSetOut.Meta):
        fields = [*s.TaskSetOut.Meta.fields, "source"]


class TaskSetGenerateView(TeamViewSet):
    serializer_class = GenerateIn  # what OPTIONS describes

    @extend_schema(request=GenerateIn, responses={201: GeneratedTaskSetOut})
    def create(self, request: Request) -> Response:
        data = _valid(GenerateIn, request.data)
        task_set = scenarios.task_set_generate(
            project=self.ref(Project, data["project"], "project"),
            environment=self.ref(Environment, data["environment"], "environment"),
            endpoint=self.ref(JudgeEndpoint, data["endpoint"], "endpoint"),
            model=data["model"],
            n=data["n"],
            instruction=data["instruction"],
            name=data["name"],
            validation_fraction=data["validation_fraction"],
            seed=data["seed"],
            interactive=True,
        )
        return Response(GeneratedTaskSetOut(task_set).data, status=status.HTTP_201_CREATED)
