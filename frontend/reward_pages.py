"""Reward definitions: the list and editor of a project's graders, validated as you type."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import messages
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from frontend import forms as f
from frontend.access import TeamHttpRequest, get_scoped, team_view
from projects import selectors, services
from projects.errors import ValidationFailed
from projects.grader_secrets import grader_public
from projects.models import (
    Project,
    RewardDefinition,
)

# --- reward definitions ----------------------------------------------------------------------

EXAMPLE_SPEC = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}


@team_view()
def rewards(request: TeamHttpRequest, project_id: int) -> HttpResponse:
    project = get_scoped(Project, request, project_id)
    form = f.RewardDefinitionForm(request.POST or None, initial={"spec": json.dumps(EXAMPLE_SPEC, indent=2)})
    if request.method == "POST" and form.is_valid():
        spec = _json_field(form, "spec")
        if spec is not None:
            try:
                definition = services.reward_definition_create(
                    project=project, name=form.cleaned_data["name"], spec=spec
                )
                return redirect("frontend:reward", reward_id=definition.pk)
            except ValidationFailed as exc:
                f.attach_errors(form, exc)
    return render(
        request,
        "frontend/rewards.html",
        {
            "project": project,
            "definitions": selectors.reward_definitions_latest(team=request.team, project=project),
            "form": form,
        },
    )


def _json_field(form: Any, name: str) -> Any:
    try:  # the API's strict reader: depth, NaN, number range, lone surrogates, NUL
        return services.json_text_read(form.cleaned_data[name])
    except ValidationFailed as exc:
        form.add_error(name, exc.message)
        return None


@team_view()
def reward(request: TeamHttpRequest, reward_id: int) -> HttpResponse:
    definition = get_scoped(RewardDefinition, request, reward_id)
    form = f.RewardDefinitionForm(
        request.POST or None,
        initial={"name": definition.name, "spec": json.dumps(grader_public(definition.spec), indent=2)},
    )
    form.fields["name"].disabled = True
    example = selectors.reward_example(definition=definition)  # one its own grader can read
    if request.method == "POST" and form.is_valid():
        spec = _json_field(form, "spec")
        if spec is not None:
            try:
                created = services.reward_definition_update(definition=definition, spec=spec)
                messages.success(request, f"Saved as version {created.version}.")
                return redirect("frontend:reward", reward_id=created.pk)
            except ValidationFailed as exc:
                f.attach_errors(form, exc)
    return render(
        request,
        "frontend/reward.html",
        {
            "definition": definition,
            "versions": selectors.reward_definition_versions(definition=definition),
            "form": form,
            "example": example,
            "example_item": json.dumps(example.item, ensure_ascii=False),
        },
    )


@require_POST
@team_view()
def grader_validate(request: TeamHttpRequest) -> JsonResponse:
    """Validation as you type in the reward editor: the same check as ``POST
    /api/v1/graders/validate`` (``services.grader_problems``), but a spec with problems is an
    answer (200), not a failed request, so typing does not fill the browser console with 400s."""
    try:
        spec = services.json_text_read(request.body).get("grader")
    except (ValidationFailed, AttributeError):
        return JsonResponse({"valid": False, "problems": ["the body must be a JSON object with a grader"]})
    try:
        normalised = services.grader_problems(spec, field="grader")
    except ValidationFailed as exc:
        return JsonResponse(
            {"valid": False, "problems": [f"{field}: {message}" for field, message in exc.problems]}
        )
    return JsonResponse({"valid": True, "grader": normalised})
