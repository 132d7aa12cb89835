"""The team's judge endpoints in the dashboard (the OpenAI-compatible endpoints LLM-judge graders
and scenario generation call): the list, "Test connection" (one short chat completion through the
graders' own client, its latency or its error), and for owners create and key rotation. The key is
stored encrypted by projects.services.judges and never shown; the API is /api/v1/judge-endpoints/."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from frontend.access import TeamHttpRequest, get_scoped, team_view
from frontend.forms import attach_errors
from projects import secrets, selectors
from projects.errors import ValidationFailed
from projects.models import JudgeEndpoint
from projects.services import judges


class JudgeEndpointForm(forms.Form):
    name = forms.CharField(
        max_length=63,
        help_text='lowercase letters, digits, ".", "_" or "-"; runs use the one named "default"',
    )
    base_url = forms.CharField(
        max_length=500,
        label="Base URL",
        help_text="ends before /chat/completions, e.g. https://api.openai.com/v1",
    )
    api_key = forms.CharField(
        required=False, label="API key", widget=forms.PasswordInput, help_text="stored encrypted, never shown"
    )
    default_model = forms.CharField(max_length=200, required=False, help_text="used when a grader names none")
    timeout_s = forms.FloatField(initial=60.0, min_value=0.001, max_value=600, label="Timeout (s)")


class RotateKeyForm(forms.Form):
    api_key = forms.CharField(required=False, label="New API key", widget=forms.PasswordInput)


def _list(request: TeamHttpRequest, **context: Any) -> HttpResponse:
    endpoints = selectors.scoped(JudgeEndpoint, request.team).order_by("name")
    rows = [
        {
            "endpoint": endpoint,
            "base_url": secrets.url_public(endpoint.base_url),
            "has_key": bool(endpoint.api_key_encrypted),
        }
        for endpoint in endpoints
    ]
    context.setdefault("form", JudgeEndpointForm())
    return render(request, "frontend/judge_endpoints.html", {"rows": rows, **context})


@team_view(owner=True)
def judge_endpoint_list(request: TeamHttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _list(request)
    form = JudgeEndpointForm(request.POST)
    if form.is_valid():
        try:
            endpoint = judges.judge_endpoint_create(team=request.team, **form.cleaned_data)
        except ValidationFailed as exc:
            attach_errors(form, exc)
        else:
            messages.success(request, f"Judge endpoint {endpoint.name} added.")
            return redirect("frontend:judge-endpoints")
    return _list(request, form=form)


@require_POST
@team_view(owner=True)
def judge_endpoint_test(request: TeamHttpRequest, endpoint_id: int) -> HttpResponse:
    """Owners only: the call spends the team's key."""
    endpoint = get_scoped(JudgeEndpoint, request, endpoint_id)
    try:
        check = judges.judge_endpoint_test(endpoint=endpoint, model=request.POST.get("model", "").strip())
    except ValidationFailed as exc:
        messages.error(request, f"{endpoint.name}: {exc.message}")
        return redirect("frontend:judge-endpoints")
    return _list(request, tested=endpoint.pk, check=check)


@require_POST
@team_view(owner=True)
def judge_endpoint_rotate(request: TeamHttpRequest, endpoint_id: int) -> HttpResponse:
    endpoint = get_scoped(JudgeEndpoint, request, endpoint_id)
    form = RotateKeyForm(request.POST)
    form.is_valid()  # one optional text field: always valid
    judges.judge_endpoint_update(endpoint=endpoint, api_key=form.cleaned_data["api_key"])
    state = "replaced" if form.cleaned_data["api_key"] else "removed (the endpoint is called without one)"
    messages.success(request, f"The API key of {endpoint.name} was {state}.")
    return redirect("frontend:judge-endpoints")
