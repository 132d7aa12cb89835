"""Task set pages: a task set with its rows and, for a generated one, the generation report; the
scenario generation form, which queues a ScenarioJob (``projects.services.scenarios.scenario_job_create``:
the input is checked at once, a worker asks the model) and the job's page, which polls its progress
(htmx, like the run page) and moves on to the new task set when it is made."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET

from frontend import forms as f
from frontend.access import TeamHttpRequest, can_write, get_scoped, team_view
from projects import selectors
from projects.errors import ValidationFailed
from projects.models import (
    Environment,
    JudgeEndpoint,
    Project,
    ScenarioJob,
    ScenarioJobStatus,
    TaskRow,
    TaskSet,
)
from projects.secrets import url_public
from projects.services import scenarios

PREVIEW_ROWS = 20


@team_view()
def task_set(request: TeamHttpRequest, task_set_id: int) -> HttpResponse:
    task_set = get_scoped(TaskSet, request, task_set_id)
    source = task_set.source or {}
    return render(
        request,
        "frontend/task_set.html",
        {
            "task_set": task_set,
            "source": source,
            "generated": source.get("type") == "generated",
            "rows": [
                (row.index, row.split, json.dumps(row.data, ensure_ascii=False))
                for row in TaskRow.objects.filter(task_set=task_set).order_by("index")[:PREVIEW_ROWS]
            ],
            "preview_rows": PREVIEW_ROWS,
            "can_write": can_write(request),
        },
    )


def _choices(request: TeamHttpRequest, project: Project) -> dict[str, list[tuple[int, str]]]:
    team = request.team
    return {
        "environment": [
            (e.pk, f"{e.name} ({e.kind})")
            for e in selectors.scoped(Environment, team).filter(project=project)
        ],
        "endpoint": [
            (
                e.pk,
                f"{e.name} ({url_public(e.base_url)}{', default model ' + e.default_model if e.default_model else ''})",
            )
            for e in selectors.judge_endpoints(team=team)
        ],
    }


@team_view(write=True)
def task_set_generate(request: TeamHttpRequest, project_id: int) -> HttpResponse:
    project = get_scoped(Project, request, project_id)
    choices = _choices(request, project)
    form = f.ScenarioForm(request.POST or None, choices=choices)
    if request.method == "POST" and choices["endpoint"] and form.is_valid():
        data = form.cleaned_data
        try:
            job = scenarios.scenario_job_create(
                project=project,
                environment=get_scoped(Environment, request, data["environment"], project=project),
                endpoint=get_scoped(JudgeEndpoint, request, data["endpoint"]),
                model=data["model"],
                n=data["n"],
                instruction=data["instruction"],
                name=data["name"],
                validation_fraction=data["validation_fraction"],
                created_by=request.user,
            )
        except ValidationFailed as exc:
            f.attach_errors(form, exc)
        else:
            return redirect("frontend:scenario-job", job_id=job.pk)
    elif request.method == "POST" and choices["endpoint"]:
        _check_the_rest(request, project, form)
    return render(
        request,
        "frontend/task_set_generate.html",
        {
            "project": project,
            "form": form,
            "has_endpoints": bool(choices["endpoint"]),
            "api_url": request.build_absolute_uri("/api/v1/judge-endpoints/"),
        },
    )


def _check_the_rest(request: TeamHttpRequest, project: Project, form: f.ScenarioForm) -> None:
    """A form with field errors: the service's checks of the fields that passed are shown with them
    (a taken name no longer waits for the next submit behind an empty instruction)."""
    data = form.cleaned_data
    if "environment" not in data or "endpoint" not in data:
        return
    try:
        scenarios.scenario_input_check(
            project=project,
            environment=get_scoped(Environment, request, data["environment"], project=project),
            endpoint=get_scoped(JudgeEndpoint, request, data["endpoint"]),
            model=data.get("model", ""),
            n=data.get("n", 1),
            instruction=data.get("instruction") or "-",  # one the form refused is not said twice
            name=data.get("name") or "-",
            validation_fraction=data.get("validation_fraction", 0.0),
        )
    except ValidationFailed as exc:
        rest = [(field, message) for field, message in exc.problems if field not in form.errors]
        if rest:
            f.attach_errors(form, ValidationFailed(rest[0][1], field=rest[0][0], problems=rest))


def _job_context(job: ScenarioJob) -> dict[str, Any]:
    return {
        "job": job,
        "active": job.status in (ScenarioJobStatus.QUEUED, ScenarioJobStatus.RUNNING),
        "percent": round(100 * job.rows_done / job.rows_total) if job.rows_total else 0,
    }


@team_view()
def scenario_job(request: TeamHttpRequest, job_id: int) -> HttpResponse:
    job = get_scoped(ScenarioJob, request, job_id)
    context = _job_context(job)
    if job.status == ScenarioJobStatus.SUCCEEDED and job.task_set_id is not None:
        # A job that finished before its page first rendered: one poll, whose HX-Redirect
        # (scenario_job_live) opens the task set as it would have mid-run.
        context["active"] = True
    return render(request, "frontend/scenario_job.html", context)


@require_GET
@team_view()
def scenario_job_live(request: TeamHttpRequest, job_id: int) -> HttpResponse:
    """The job page's live part, polled while the job is queued or running; once the task set is
    made, htmx is told to open it (HX-Redirect) with the report's summary as a message."""
    job = get_scoped(ScenarioJob, request, job_id)
    response = render(request, "frontend/_scenario_job_live.html", _job_context(job))
    if (
        job.status == ScenarioJobStatus.SUCCEEDED
        and job.task_set is not None
        and request.headers.get("HX-Request")
    ):
        report = job.task_set.source or {}
        messages.success(
            request,
            f"Generated task set {job.task_set.name}: {report.get('accepted', 0)} rows accepted, "
            f"{report.get('rejected', 0)} rejected.",
        )
        response["HX-Redirect"] = reverse("frontend:task-set", kwargs={"task_set_id": job.task_set_id})
    return response
