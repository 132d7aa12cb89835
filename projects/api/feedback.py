"""Rewards on stored completions after the fact, and training on them: ``/api/v1/feedback`` (a
value on a completion or a conversation), ``/api/v1/completion-gradings`` (a reward definition over
stored completions, in the background) and ``/api/v1/stored-completions/train`` (a training step of
a model on its rated stored completions, or a schedule of steps, which ``.../train/{schedule_id}``
follows and ``.../train/{schedule_id}/cancel`` cancels). Rows through projects.selectors, writes
through projects.services.completions, completion_training and training_jobs."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db.models import F, QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.api.base import TeamViewSet
from projects.api.pagination import list_body, page_of
from projects.api.serializers import InputSerializer, NoBodyIn
from projects.errors import NotFound, ValidationFailed
from projects.gateway.capture import checked_metadata
from projects.gateway.errors import GatewayError
from projects.models import (
    CompletionFeedback,
    CompletionGrading,
    RewardDefinition,
    TrainableModel,
    TrainingJob,
)
from projects.services.completion_training import training_schedule_status
from projects.services.judges import judge_client as judge_client_check
from projects.services.training_jobs import training_schedule_cancel

MAX_LIMIT = 100  # as the stored completions list (projects.api.completions)


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
    schedule = serializers.JSONField(
        required=False,
        allow_null=True,
        help_text="several steps: {steps, groups_per_step, epochs, learning_rate, lr_schedule "
        "(constant | linear | cosine), warmup_steps, min_lr_ratio, seed}",
    )


class TrainOnCompletionsView(TeamViewSet):
    """``/api/v1/stored-completions/train``: one off-policy training step of a model on stored
    completions and their rewards (projects.services.completion_training.training_job_from_completions);
    the answer is the training job, which ``/v1/preview/training-jobs/{id}`` follows.

    With ``schedule``, several steps on the same groups (training_schedule_from_completions), one
    training job each, run in order: the answer is the schedule (``schedule_body``) with
    ``"groups_per_step": [one per step]`` and ``"counts"``; ``TrainingScheduleView`` follows it."""

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
        if data.get("schedule") is not None:
            steps, counts = services.training_schedule_from_completions(
                model=model, completions=rows, schedule=data["schedule"],
                experimental_config=data.get("experimental_config"),
                created_by=user if isinstance(user, User) else None,
            )  # fmt: skip
            body = schedule_body([step.job for step in steps])
            body.update(groups_per_step=[step.groups for step in steps], counts=counts)
            return Response(body, status=status.HTTP_201_CREATED)
        job, counts = services.training_job_from_completions(
            model=model, completions=rows, experimental_config=data.get("experimental_config"),
            created_by=user if isinstance(user, User) else None,
        )  # fmt: skip
        return Response({"object": "training_job", "id": job.pk, "status": job.status, "model": model.pk,
                         "counts": counts}, status=status.HTTP_201_CREATED)  # fmt: skip


def schedule_body(jobs: list[TrainingJob]) -> dict[str, Any]:
    """A schedule from its jobs in step order: its id (its first job's), its status (queued, running,
    succeeded, failed or cancelled), and per step, in step order, the job, its status and its rate."""
    return {
        "id": jobs[0].pk,
        "object": "training_schedule",
        "model": jobs[0].model_id,
        "status": training_schedule_status(jobs),
        "steps": len(jobs),
        "jobs": [job.pk for job in jobs],
        "statuses": [job.status for job in jobs],
        "learning_rates": [job.config.get("learning_rate") for job in jobs],
        "created_at": int(jobs[0].created_at.timestamp()),
    }


class TrainingScheduleView(TeamViewSet):
    """``/api/v1/stored-completions/train/{schedule_id}`` (the schedule, ``schedule_body``) and
    ``.../cancel``, shaped like OpenAI's ``POST /fine_tuning/jobs/{id}/cancel``: its unfinished jobs
    end as cancelled (failed, with an error that starts ``cancelled:``; a running one stops as a
    failed job does) and the answer is the schedule. Cancelling again changes nothing and answers
    the same. A schedule's id is its first job's; another job's id is not a schedule (404)."""

    model = TrainingJob
    lookup_url_kwarg = "schedule_id"

    def base_queryset(self) -> QuerySet:
        return TrainingJob.objects.filter(schedule_id=F("pk"))

    @extend_schema(operation_id="training_schedules_retrieve", responses={200: dict})
    def retrieve(self, request: Request, schedule_id: str) -> Response:
        return Response(schedule_body(selectors.training_schedule_jobs(schedule=self.get_object())))

    @extend_schema(operation_id="training_schedules_cancel", request=None, responses={200: dict})
    def cancel(self, request: Request, schedule_id: str) -> Response:
        NoBodyIn(data=request.data).is_valid(raise_exception=True)
        return Response(schedule_body(training_schedule_cancel(schedule=self.get_object())))
