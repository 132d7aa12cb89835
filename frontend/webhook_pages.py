"""The team's webhooks in the dashboard: endpoints, their delivery log, "send test event",
"redeliver", secret rotation. Everyone in the team reads; owners write (projects.services.webhooks
holds every rule; the API is /api/v1/webhooks/)."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from frontend.access import TeamHttpRequest, get_scoped, team_view
from frontend.forms import attach_errors
from projects.errors import ValidationFailed
from projects.models import WEBHOOK_EVENT_TYPES, WebhookEndpoint
from projects.services import webhooks

RECENT_DELIVERIES = 50


class WebhookForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="lowercase letters, digits, '.', '_' or '-'")
    url = forms.CharField(max_length=1000, label="URL", help_text="https:// endpoint that receives the POSTs")
    events = forms.MultipleChoiceField(
        choices=[
            (t, t)
            for t in ("*", "run.*", "evaluation.*", "training_job.*", "model_alias.*", *WEBHOOK_EVENT_TYPES)
        ],
        widget=forms.CheckboxSelectMultiple,
        initial=["run.*"],
    )


@team_view(owner=True)
def webhook_list(request: TeamHttpRequest) -> HttpResponse:
    form = WebhookForm(request.POST or None)
    created = None
    if request.method == "POST" and form.is_valid():
        try:
            created = webhooks.webhook_endpoint_create(team=request.team, **form.cleaned_data)
            form = WebhookForm()
        except ValidationFailed as exc:
            attach_errors(form, exc)
    endpoints = WebhookEndpoint.objects.filter(team=request.team).order_by("name")
    return render(
        request, "frontend/webhooks.html", {"endpoints": endpoints, "form": form, "created": created}
    )


@team_view(owner=True)
def webhook_detail(request: TeamHttpRequest, webhook_id: int) -> HttpResponse:
    endpoint = get_scoped(WebhookEndpoint, request, webhook_id)
    deliveries = endpoint.deliveries.order_by("-id")[:RECENT_DELIVERIES]
    return render(request, "frontend/webhook.html", {"endpoint": endpoint, "deliveries": deliveries})


@require_POST
@team_view(owner=True)
def webhook_test(request: TeamHttpRequest, webhook_id: int) -> HttpResponse:
    endpoint = get_scoped(WebhookEndpoint, request, webhook_id)
    delivery = webhooks.webhook_test(endpoint=endpoint)
    messages.success(request, f"Test event {delivery.event_id} queued; its outcome appears below.")
    return redirect("frontend:webhook", webhook_id=endpoint.pk)


@require_POST
@team_view(owner=True)
def webhook_redeliver(request: TeamHttpRequest, webhook_id: int, delivery_id: int) -> HttpResponse:
    endpoint = get_scoped(WebhookEndpoint, request, webhook_id)
    delivery = endpoint.deliveries.filter(pk=delivery_id).first()
    if delivery is None:
        messages.error(request, "That delivery does not belong to this webhook.")
    else:
        again = webhooks.webhook_redeliver(delivery=delivery)
        messages.success(request, f"Event {again.event_id} queued again.")
    return redirect("frontend:webhook", webhook_id=endpoint.pk)


@require_POST
@team_view(owner=True)
def webhook_rotate(request: TeamHttpRequest, webhook_id: int) -> HttpResponse:
    endpoint = get_scoped(WebhookEndpoint, request, webhook_id)
    secret = webhooks.webhook_secret_rotate(endpoint=endpoint)
    deliveries = endpoint.deliveries.order_by("-id")[:RECENT_DELIVERIES]
    context = {"endpoint": endpoint, "deliveries": deliveries, "secret": secret}
    return render(request, "frontend/webhook.html", context)


@require_POST
@team_view(owner=True)
def webhook_delete(request: TeamHttpRequest, webhook_id: int) -> HttpResponse:
    endpoint = get_scoped(WebhookEndpoint, request, webhook_id)
    webhooks.webhook_endpoint_delete(endpoint=endpoint)
    messages.success(request, f"Webhook {endpoint.name} deleted.")
    return redirect("frontend:webhooks")
