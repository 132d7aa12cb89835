"""OpenAI's fine-tuning API under ``/v1/``: ``files``, ``fine_tuning/jobs`` (create, list, retrieve,
cancel, pause, resume, events, checkpoints) and ``fine_tuning/alpha/graders/{run,validate}``, so
the ``openai`` client's fine-tuning calls train on artweb unchanged (projects.services.fine_tuning
says how the objects map). DRF views on the tenancy base, like ``/v1/preview/``: team API keys, the
caller's team only (another team's file, job or checkpoint is a 404), a read-only key cannot
create, OpenAI's error objects. Rows are read through projects.selectors and written through
projects.services, never queried here. Ids are OpenAI's shape (``file-12``, ``ftjob-7``,
``ftevent-40``, ``ftckpt-3``); lists are newest first with ``after`` (the last id seen) and ``limit``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from projects import selectors, services
from projects.api.base import TeamViewSet
from projects.api.pagination import DEFAULT_LIMIT, MAX_LIMIT, int_query_param, list_body, rows_after
from projects.api.serializers import InputSerializer
from projects.api.views import upload_text
from projects.errors import Conflict, NotFound, ValidationFailed
from projects.grader_secrets import grader_public
from projects.models import Checkpoint, Run, RunEvent, RunStatus, StepMetrics, TaskSet
from projects.services import fine_tuning
from projects.services.fine_tuning import parse_id


def _stamp(moment: Any) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def _page(request: Request, queryset: Any, prefix: str, body: Callable[[Any], dict[str, Any]]) -> Response:
    """One page of ``queryset`` (its own order) for OpenAI's ``?after=<prefix>-<n>&limit=``."""
    limit = int_query_param(request, "limit", DEFAULT_LIMIT if prefix != "ftevent" else 20)
    if limit is None or not 1 <= limit <= MAX_LIMIT:
        raise ValidationFailed(f"must be between 1 and {MAX_LIMIT}", field="limit")
    after = request.query_params.get("after")
    if after:
        number = parse_id(after, prefix)
        if number is None:
            raise ValidationFailed(f"must be an id of this list ({prefix}-…)", field="after")
        queryset = rows_after(queryset, number)
    rows = list(queryset[: limit + 1])
    return Response(list_body([body(row) for row in rows[:limit]], has_more=len(rows) > limit))


def _header_project(request: Request) -> str | None:
    return request.headers.get("OpenAI-Project") or None


# ---------------------------------------------------------------- files


def file_body(task_set: TaskSet) -> dict[str, Any]:
    meta = task_set.source.get("openai_file", {})
    return {
        "id": f"file-{task_set.pk}",
        "object": "file",
        "bytes": meta.get("bytes", 0),
        "created_at": _stamp(task_set.created_at),
        "filename": meta.get("filename", f"{task_set.name}.jsonl"),
        "purpose": "fine-tune",
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


RESULT_COLUMNS = (
    "step",
    "train_loss",
    "train_mean_reward",
    "train_reward_std",
    "learning_rate",
    "trainable_tokens",
)


def results_csv(run: Run) -> str:
    """A finished job's result file, as OpenAI's: one CSV line of metrics per step."""
    lines = [",".join(RESULT_COLUMNS)]
    for step in selectors.run_step_metrics(run=run):
        values = (step.step, step.loss, step.reward_mean, step.reward_std,
                  step.metrics.get("learning_rate"), step.metrics.get("trainable_tokens"))  # fmt: skip
        lines.append(",".join("" if value is None else f"{value:g}" for value in values))
    return "\n".join(lines) + "\n"


def results_file_body(run: Run) -> dict[str, Any]:
    return {
        "id": f"file-r{run.pk}",
        "object": "file",
        "bytes": len(results_csv(run).encode()),
        "created_at": _stamp(run.finished_at),
        "filename": "step_metrics.csv",
        "purpose": "fine-tune-results",
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


class FileIn(InputSerializer):
    """What OPTIONS and the schema describe; projects.services.fine_tuning checks the rows."""

    file = serializers.FileField(help_text="JSONL in OpenAI's reinforcement, chat or preference format")
    purpose = serializers.ChoiceField(choices=["fine-tune"])


class JobIn(InputSerializer):
    """OpenAI's job body, for OPTIONS and the schema; projects.services.fine_tuning.job_create
    checks every field (and refuses any other) with a 400 naming it."""

    model = serializers.CharField(help_text="a base model's catalogue name")
    training_file = serializers.CharField(help_text="file-<n>")
    validation_file = serializers.CharField(required=False, allow_null=True)
    suffix = serializers.CharField(required=False, allow_null=True, max_length=64)
    seed = serializers.IntegerField(required=False, allow_null=True)
    metadata = serializers.DictField(child=serializers.CharField(), required=False, allow_null=True)
    method = serializers.JSONField(
        required=False,
        help_text="{type: reinforcement|supervised|dpo, <type>: {...}}; reinforcement may add tools, "
        "max_episode_steps and max_tool_calls (Agent RFT: projects.services.agent_rft)",
    )
    hyperparameters = serializers.JSONField(
        required=False, help_text="deprecated: supervised hyperparameters"
    )
    integrations = serializers.JSONField(required=False, help_text="refused unless empty")


class FilesView(TeamViewSet):
    """``/v1/files``: a file is a task set of the project (every task set of it lists as one)."""

    model = TaskSet
    serializer_class = FileIn  # what OPTIONS describes

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        # ``content`` answers bytes whatever the client accepts (the openai client sends
        # ``Accept: application/binary``); errors stay JSON.
        return super().perform_content_negotiation(request, force=force or self.action == "content")

    def _project(self, *, create: bool) -> Any:
        return fine_tuning.job_project(team=self.team, name=_header_project(self.request), create=create)

    def _results_of(self, file_id: str) -> Run | None:
        """The finished job whose result file ``file_id`` is (``file-r<job>``), or None when it
        names no result file; another team's is a 404."""
        if not file_id.startswith("file-r"):
            return None
        number = parse_id("file-" + file_id.removeprefix("file-r"), "file")
        run = None
        if number is not None:
            run = selectors.fine_tuning_job_run(team=self.team, number=number)
        if run is None or run.status != RunStatus.SUCCEEDED:
            raise NotFound(f"No such File object: {file_id}", field="file_id")
        return run

    def _task_set(self, file_id: str) -> TaskSet:
        number = parse_id(file_id, "file")
        found = None if number is None else selectors.fine_tuning_file(team=self.team, number=number)
        if found is None:
            raise NotFound(f"No such File object: {file_id}", field="file_id")
        return found

    @extend_schema(
        operation_id="files_create", request={"multipart/form-data": FileIn}, responses={200: dict}
    )
    def create(self, request: Request) -> Response:
        upload = request.FILES.get("file")
        if upload is None:
            raise ValidationFailed("attach the JSONL file as multipart field 'file'", field="file")
        text = upload_text(upload)
        project = self._project(create=True)
        assert project is not None  # create=True makes it
        task_set = fine_tuning.file_create(
            project=project,
            filename=upload.name or "file.jsonl",
            jsonl=text,
            purpose=str(request.data.get("purpose", "")) if isinstance(request.data, dict) else "",
        )
        return Response(file_body(task_set), status=status.HTTP_200_OK)

    @extend_schema(operation_id="files_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        purpose = request.query_params.get("purpose")
        if purpose not in (None, "", "fine-tune"):
            return Response(list_body([]))  # no file of any other purpose exists here
        project = self._project(create=False)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ValidationFailed("must be asc or desc", field="order")
        queryset = selectors.fine_tuning_files(team=self.team, project=project, ascending=order == "asc")
        return _page(request, queryset, "file", file_body)

    @extend_schema(operation_id="files_retrieve", responses={200: dict})
    def retrieve(self, request: Request, file_id: str) -> Response:
        if (run := self._results_of(file_id)) is not None:
            return Response(results_file_body(run))
        return Response(file_body(self._task_set(file_id)))

    @extend_schema(operation_id="files_delete", responses={200: dict})
    def destroy(self, request: Request, file_id: str) -> Response:
        if self._results_of(file_id) is not None:
            raise Conflict("a job's result file is its run's step metrics: delete the job's run instead",
                           field="file_id", code="in_use")  # fmt: skip
        task_set = self._task_set(file_id)
        services.task_set_delete(task_set=task_set)
        return Response({"id": file_id, "object": "file", "deleted": True})

    @extend_schema(operation_id="files_content", responses={200: str})
    def content(self, request: Request, file_id: str) -> HttpResponse:
        if (run := self._results_of(file_id)) is not None:
            return HttpResponse(results_csv(run), content_type="text/csv; charset=utf-8")
        rows = selectors.task_set_rows(task_set=self._task_set(file_id), split="all")
        lines = [json.dumps(fine_tuning.openai_line(row["data"]), ensure_ascii=False) for row in rows]
        return HttpResponse("\n".join(lines) + "\n", content_type="application/jsonl; charset=utf-8")


# ---------------------------------------------------------------- jobs

METADATA_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")
STATUSES: dict[str, str] = {  # a run's status as a job's (the same words but for nothing)
    RunStatus.QUEUED: "queued",
    RunStatus.RUNNING: "running",
    RunStatus.PAUSED: "paused",
    RunStatus.SUCCEEDED: "succeeded",
    RunStatus.FAILED: "failed",
    RunStatus.CANCELLED: "cancelled",
}


def checkpoint_name(checkpoint: Checkpoint) -> str:
    """The model id ``/v1/chat/completions`` serves the checkpoint under (projects.gateway.routing)."""
    return f"{checkpoint.model.project.name}/{checkpoint.model.name}:{checkpoint.step}"


def job_body(run: Run) -> dict[str, Any]:
    asked = run.fine_tuning
    latest = selectors.job_latest_checkpoint(run=run)
    tokens = None  # OpenAI fills it once the job has succeeded
    if run.status == RunStatus.SUCCEEDED:
        tokens = selectors.job_trained_tokens(run=run)
    estimated = None
    left = selectors.run_seconds_left(run=run)  # the recorded steps' own durations, not the time before them
    if left is not None:
        estimated = _stamp((run.heartbeat_at or timezone.now()) + timedelta(seconds=left))
    method = asked["method"]
    return {
        "object": "fine_tuning.job",
        "id": f"ftjob-{run.pk}",
        "model": asked["model"],
        "created_at": _stamp(run.created_at),
        "finished_at": _stamp(run.finished_at),
        "fine_tuned_model": checkpoint_name(latest) if latest and run.status == RunStatus.SUCCEEDED else None,
        "organization_id": f"team-{run.project.team_id}",
        "result_files": [f"file-r{run.pk}"] if run.status == RunStatus.SUCCEEDED else [],
        "status": STATUSES[run.status],
        "validation_file": f"file-{asked['validation_file']}" if asked.get("validation_file") else None,
        "training_file": f"file-{asked['training_file']}",
        "hyperparameters": method[method["type"]]["hyperparameters"],
        "trained_tokens": tokens,
        "error": {"code": "run_failed", "message": run.error, "param": None}
        if run.status == RunStatus.FAILED
        else None,
        "user_provided_suffix": asked.get("suffix"),
        "seed": asked.get("seed"),
        "estimated_finish": estimated,
        "integrations": [],
        "metadata": asked.get("metadata"),
        "method": method_public(method),
        # artweb's own: the run behind the job (dashboard, /api/v1/runs/{id}/)
        "run_id": run.pk,
    }


def method_public(method: dict[str, Any]) -> dict[str, Any]:
    """A job's ``method`` as read back: an endpoint grader's header values masked (a job created
    before they were masked on storage stored them as given)."""
    settings = method.get(method.get("type", ""))
    if not isinstance(settings, dict) or "grader" not in settings:
        return method
    return {**method, method["type"]: {**settings, "grader": grader_public(settings["grader"])}}


def event_body(event: RunEvent, run: Run) -> dict[str, Any]:
    data = dict(event.data)
    if event.type == "metrics":
        data.setdefault("total_steps", run.start_step + run.total_steps)
        if data.get("loss") is not None:
            data["train_loss"] = data["loss"]
        if data.get("reward_mean") is not None:
            data["train_mean_reward"] = data["reward_mean"]
    return {
        "object": "fine_tuning.job.event",
        "id": f"ftevent-{event.pk}",
        "created_at": _stamp(event.created_at),
        "level": event.level,
        "message": event.message,
        "data": data,
        "type": event.type,
    }


def checkpoint_body(checkpoint: Checkpoint, run: Run, step: StepMetrics | None) -> dict[str, Any]:
    metrics: dict[str, Any] = {"step": checkpoint.step}
    if step is not None:
        metrics.update(train_loss=step.loss, train_mean_reward=step.reward_mean)
    for key, value in (checkpoint.metrics or {}).items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            metrics[key] = value
    return {
        "object": "fine_tuning.job.checkpoint",
        "id": f"ftckpt-{checkpoint.pk}",
        "created_at": _stamp(checkpoint.created_at),
        "fine_tuned_model_checkpoint": checkpoint_name(checkpoint),
        "fine_tuning_job_id": f"ftjob-{run.pk}",
        "metrics": metrics,
        "step_number": checkpoint.step,
    }


class JobsView(TeamViewSet):
    """``/v1/fine_tuning/jobs``: a job is a run created through this API."""

    model = Run
    serializer_class = JobIn  # what OPTIONS describes

    def _job(self, job_id: str) -> Run:
        return fine_tuning.job_lookup(team=self.team, job_id=job_id)

    @extend_schema(operation_id="fine_tuning_jobs_create", request=JobIn, responses={200: dict})
    def create(self, request: Request) -> Response:
        if not isinstance(request.data, dict):
            raise ValidationFailed("the body must be a JSON object", field="non_field_errors")
        project = fine_tuning.job_project(team=self.team, name=_header_project(request), create=True)
        assert project is not None  # create=True makes it
        user = request.user if getattr(request.user, "is_authenticated", False) and request.user.pk else None
        run = fine_tuning.job_create(project=project, body=dict(request.data), created_by=user)
        return Response(job_body(run))

    @extend_schema(operation_id="fine_tuning_jobs_list", responses={200: dict})
    def list(self, request: Request) -> Response:
        metadata: dict[str, Any] = {}
        for key, value in request.query_params.items():
            if key.startswith("metadata[") and key.endswith("]"):
                name = key[len("metadata[") : -1]
                if not METADATA_KEY.fullmatch(name) or "__" in name:
                    raise ValidationFailed(
                        "a metadata key is letters, digits, - and _ (64 at most)", field=key
                    )
                metadata[name] = value
        queryset = selectors.fine_tuning_jobs(
            team=self.team, project_name=_header_project(request), metadata=metadata
        )
        return _page(request, queryset, "ftjob", job_body)

    @extend_schema(operation_id="fine_tuning_jobs_retrieve", responses={200: dict})
    def retrieve(self, request: Request, job_id: str) -> Response:
        return Response(job_body(self._job(job_id)))

    def _control(self, job_id: str, action: Callable[..., Run]) -> Response:
        run = self._job(job_id)
        action(run=run)
        return Response(job_body(selectors.run_get(team=self.team, run_id=run.pk)))

    @extend_schema(operation_id="fine_tuning_jobs_cancel", request=None, responses={200: dict})
    def cancel(self, request: Request, job_id: str) -> Response:
        return self._control(job_id, services.run_cancel)

    @extend_schema(operation_id="fine_tuning_jobs_pause", request=None, responses={200: dict})
    def pause(self, request: Request, job_id: str) -> Response:
        return self._control(job_id, services.run_pause)

    @extend_schema(operation_id="fine_tuning_jobs_resume", request=None, responses={200: dict})
    def resume(self, request: Request, job_id: str) -> Response:
        return self._control(job_id, services.run_resume)

    @extend_schema(operation_id="fine_tuning_jobs_events", responses={200: dict})
    def events(self, request: Request, job_id: str) -> Response:
        run = self._job(job_id)
        queryset = selectors.job_events(run=run)
        return _page(request, queryset, "ftevent", lambda event: event_body(event, run))

    @extend_schema(operation_id="fine_tuning_jobs_checkpoints", responses={200: dict})
    def checkpoints(self, request: Request, job_id: str) -> Response:
        run = self._job(job_id)
        steps = selectors.job_step_losses(run=run)
        return _page(
            request,
            selectors.job_checkpoints(run=run),
            "ftckpt",
            lambda checkpoint: checkpoint_body(checkpoint, run, steps.get(checkpoint.step)),
        )
