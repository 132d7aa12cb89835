"""Task set pages: a task set with its rows and, for a generated one, the generation report; and
the scenario generation form, which calls ``projects.services.scenarios.task_set_generate`` (the same service
as ``POST /api/v1/task-sets/generate``) synchronously: the service bounds the time it takes."""

from __future__ import annotations

import json

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render

from frontend import forms as f
from frontend.access import TeamHttpRequest, can_write, get_scoped, team_view
from projects import selectors
from projects.errors import ValidationFailed
from projects.models import Environment, JudgeEndpoint, Project, TaskRow, TaskSet
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
    row_errors: list[tuple[str, str]] = []
    if request.method == "POST" and choices["endpoint"] and form.is_valid():
        data = form.cleaned_data
        try:
            created = scenarios.task_set_generate(
                project=project,
                environment=get_scoped(Environment, request, data["environment"], project=project),
                endpoint=get_scoped(JudgeEndpoint, request, data["endpoint"]),
                model=data["model"],
                n=data["n"],
                instruction=data["instruction"],
                name=data["name"],
                validation_fraction=data["validation_fraction"],
            )
        except ValidationFailed as exc:
            # No valid row at all: the message goes next to the field it blames (the instruction,
            # or the endpoint when every request failed) and the per-row errors are listed below.
            row_errors = [
                (where, message)
                for where, message in exc.problems
                if where.startswith(("rows[", "requests["))
            ]
            if row_errors:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                f.attach_errors(form, exc)
        else:
            report = created.source
            messages.success(
                request,
                f"Generated task set {created.name}: {report.get('accepted', 0)} rows accepted, "
                f"{report.get('rejected', 0)} rejected.",
            )
            return redirect("frontend:task-set", task_set_id=created.pk)
    return render(
        request,
        "frontend/task_set_generate.html",
        {
            "project": project,
            "form": form,
            "row_errors": row_errors,
            "has_endpoints": bool(choices["endpoint"]),
            "api_url": request.build_absolute_uri("/api/v1/judge-endpoints/"),
        },
    )
