"""Webhooks: a team's endpoints hear about its runs, evaluations, checkpoints and training jobs.

Invariants: a delivery row is written in the transaction of what it reports and sent only after
that commits (so a rolled-back transition is never announced); every attempt re-checks the URL
against the operator's outbound policy and connects to the checked address (projects.outbound), so
an endpoint on a private address, or a name rebound to one, is never called.

Signing (documented in the README, "Webhooks"): each POST carries ``Artweb-Webhook-Id`` (the event
id, the same on every attempt and on a redelivery: receivers deduplicate by it),
``Artweb-Webhook-Timestamp`` (Unix seconds of this attempt) and ``Artweb-Webhook-Signature:
v1=<hex>``, the HMAC-SHA256 under the endpoint's secret of ``"<timestamp>.<raw body>"``. A receiver
recomputes it over the raw body, compares in constant time, and refuses timestamps more than a few
minutes from its clock (replay protection).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import secrets as stdlib_secrets
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.views.decorators.debug import sensitive_variables

from projects.errors import ValidationFailed
from projects.models import (
    WEBHOOK_EVENT_TYPES,
    Checkpoint,
    DeliveryStatus,
    Evaluation,
    Project,
    Run,
    Team,
    TrainableModel,
    TrainingJob,
    WebhookDelivery,
    WebhookEndpoint,
)
from projects.outbound import outbound_policy, outbound_url_checked
from projects.secrets import decrypt, encrypt, url_credentials_refused
from projects.services._common import check_slug, create_unique
from training.names import unknown
from training.safety.outbound import OutboundRefused, upstream_reason

SECRET_PREFIX = "whsec_"
ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER = (
    "Artweb-Webhook-Id",
    "Artweb-Webhook-Timestamp",
    "Artweb-Webhook-Signature",
)
ERROR_LIMIT = 500


@dataclass(frozen=True)
class CreatedWebhook:
    endpoint: WebhookEndpoint
    secret: str = field(repr=False)  # shown once; never in a repr (an error page's locals)


def _check_events(events: Any) -> list[str]:
    if not isinstance(events, list) or not events or not all(isinstance(e, str) for e in events):
        raise ValidationFailed("must be a non-empty list of event types", field="events")
    prefixes = {event_type.split(".")[0] for event_type in WEBHOOK_EVENT_TYPES}
    patterns = [*WEBHOOK_EVENT_TYPES, *(f"{prefix}.*" for prefix in sorted(prefixes)), "*"]
    for index, event in enumerate(events):
        if event not in patterns:
            raise ValidationFailed(unknown("event type", event, patterns), field=f"events[{index}]")
    return sorted(set(events))


def _check_url(url: Any) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ValidationFailed("must be an http:// or https:// URL", field="url")
    url = url.strip()
    url_credentials_refused(url, field="url")
    # Loopback, link-local and private ranges refused; a non-ASCII host stored as its IDNA name.
    return outbound_url_checked(
        url, field="url", max_length=WebhookEndpoint._meta.get_field("url").max_length
    )


def _new_secret() -> str:
    return f"{SECRET_PREFIX}{stdlib_secrets.token_urlsafe(32)}"


@sensitive_variables("secret")  # the signing secret, in plaintext
def webhook_endpoint_create(*, team: Team, name: str, url: str, events: list[str]) -> CreatedWebhook:
    check_slug(name, "name")
    url, events = _check_url(url), _check_events(events)
    secret = _new_secret()
    endpoint = create_unique(
        lambda: WebhookEndpoint.objects.create(
            team=team, name=name, url=url, events=events, secret_encrypted=encrypt(secret)
        ),
        field="name",
        message=f"the team already has a webhook named {name!r}",
    )
    return CreatedWebhook(endpoint, secret)


def webhook_endpoint_update(
    *,
    endpoint: WebhookEndpoint,
    url: str | None = None,
    events: list[str] | None = None,
    active: bool | None = None,
) -> WebhookEndpoint:
    if url is not None:
        endpoint.url = _check_url(url)
    if events is not None:
        endpoint.events = _check_events(events)
    if active is not None:
        endpoint.active = bool(active)
    endpoint.save()
    return endpoint


@sensitive_variables("secret")  # the signing secret, in plaintext
def webhook_secret_rotate(*, endpoint: WebhookEndpoint) -> str:
    """A new signing secret, effective for the next attempt; returned once."""
    secret = _new_secret()
    endpoint.secret_encrypted = encrypt(secret)
    endpoint.save(update_fields=["secret_encrypted"])
    return secret


def webhook_endpoint_delete(*, endpoint: WebhookEndpoint) -> None:
    endpoint.delete()


def subscribed(patterns: list[str], event_type: str) -> bool:
    prefix = event_type.split(".")[0]
    return any(p in ("*", event_type, f"{prefix}.*") for p in patterns)


def new_event_id() -> str:
    return f"evt_{stdlib_secrets.token_hex(12)}"


def webhook_emit(*, team_id: int, type: str, data: dict[str, Any]) -> list[WebhookDelivery]:
    """One delivery per active endpoint of the team subscribed to ``type``, sent after the current
    transaction commits. The body is OpenAI's event shape: ``{id, object: "event", type,
    created_at, data}``."""
    if type not in WEBHOOK_EVENT_TYPES:
        raise ValueError(f"unknown webhook event type {type!r}")
    endpoints = [
        endpoint
        for endpoint in WebhookEndpoint.objects.filter(team_id=team_id, active=True)
        if subscribed(endpoint.events, type)
    ]
    if not endpoints:
        return []
    event_id = new_event_id()
    payload = {"id": event_id, "object": "event", "type": type, "created_at": int(time.time()), "data": data}
    deliveries = [
        WebhookDelivery.objects.create(endpoint=endpoint, event_id=event_id, event_type=type, payload=payload)
        for endpoint in endpoints
    ]
    for delivery in deliveries:
        _enqueue(delivery.pk)
    return deliveries


# --- what is announced: the object's id, state and where to read more (the REST API) -----------


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def announce_run(run: Run) -> None:
    """``run.<status>`` for a run that just became succeeded, failed, cancelled or paused."""
    event_type = f"run.{run.status}"
    if event_type not in WEBHOOK_EVENT_TYPES:
        return
    data = {
        "object": "run", "id": run.pk, "status": run.status, "project": run.project_id, "model": run.model_id,
        "kind": run.kind, "current_step": run.current_step, "total_steps": run.total_steps, "error": run.error,
        "finished_at": _iso(run.finished_at),
    }  # fmt: skip
    webhook_emit(
        team_id=Project.objects.values_list("team_id", flat=True).get(pk=run.project_id),
        type=event_type,
        data=data,
    )


def announce_evaluation(evaluation: Evaluation) -> None:
    event_type = f"evaluation.{evaluation.status}"
    if event_type not in WEBHOOK_EVENT_TYPES:
        return
    results = evaluation.results or {}
    data = {
        "object": "evaluation", "id": evaluation.pk, "status": evaluation.status, "project": evaluation.project_id,
        "run": evaluation.run_id, "checkpoint": evaluation.checkpoint_id, "error": evaluation.error,
        "reward_mean": results.get("reward_mean"), "pass_rate": results.get("pass_rate"),
        "finished_at": _iso(evaluation.finished_at),
    }  # fmt: skip
    team_id = Project.objects.values_list("team_id", flat=True).get(pk=evaluation.project_id)
    webhook_emit(team_id=team_id, type=event_type, data=data)


def announce_checkpoint(checkpoint: Checkpoint) -> None:
    model = TrainableModel.objects.select_related("project").get(pk=checkpoint.model_id)
    data = {
        "object": "checkpoint", "id": checkpoint.pk, "model": model.pk, "run": checkpoint.run_id,
        "step": checkpoint.step, "inference_model": f"{model.project.name}/{model.name}:{checkpoint.step}",
    }  # fmt: skip
    webhook_emit(team_id=model.project.team_id, type="checkpoint.created", data=data)


def announce_training_job(job: TrainingJob) -> None:
    event_type = f"training_job.{job.status}"
    if event_type not in WEBHOOK_EVENT_TYPES:
        return
    model = TrainableModel.objects.select_related("project").get(pk=job.model_id)
    data = {
        "object": "training_job", "id": job.pk, "status": job.status, "model": model.pk, "run": job.run_id,
        "error": getattr(job, "error", ""), "finished_at": _iso(job.finished_at),
    }  # fmt: skip
    webhook_emit(team_id=model.project.team_id, type=event_type, data=data)


def webhook_test(*, endpoint: WebhookEndpoint) -> WebhookDelivery:
    """A ``webhook.test`` event to this endpoint only (whatever it subscribes to)."""
    event_id = new_event_id()
    payload = {
        "id": event_id, "object": "event", "type": "webhook.test", "created_at": int(time.time()),
        "data": {"object": "webhook", "id": endpoint.pk, "name": endpoint.name},
    }  # fmt: skip
    delivery = WebhookDelivery.objects.create(
        endpoint=endpoint, event_id=event_id, event_type="webhook.test", payload=payload
    )
    _enqueue(delivery.pk)
    return delivery


def webhook_redeliver(*, delivery: WebhookDelivery) -> WebhookDelivery:
    """The same event (same id and body) again, as a new delivery with its own attempts."""
    again = WebhookDelivery.objects.create(
        endpoint=delivery.endpoint, event_id=delivery.event_id, event_type=delivery.event_type,
        payload=delivery.payload,
    )  # fmt: skip
    _enqueue(again.pk)
    return again


def _enqueue(delivery_id: int) -> None:
    from projects.jobs.tasks import deliver_webhook

    transaction.on_commit(lambda: deliver_webhook.delay(delivery_id))


@sensitive_variables("secret")  # the signing secret, in plaintext
def signature(secret: str, timestamp: int, body: bytes) -> str:
    """``v1=<hex>``: HMAC-SHA256 of ``b"<timestamp>." + body`` under ``secret``."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={digest}"


@dataclass(frozen=True)
class Attempt:
    delivered: bool
    retry_in_s: float | None  # None: no further attempt (delivered, or given up)


def retry_delay(attempts: int) -> float:
    """Exponential backoff after ``attempts`` failed attempts, capped."""
    return float(min(settings.WEBHOOK_RETRY_BASE_S * 2 ** (attempts - 1), settings.WEBHOOK_RETRY_MAX_S))


@sensitive_variables("secret")  # the signing secret, in plaintext
def webhook_attempt(*, delivery_id: int) -> Attempt:
    """POST the delivery once and record the outcome. A delivery already settled is left alone
    (a duplicate task message); a URL the policy refuses fails at once, with no retry."""
    with transaction.atomic():
        delivery = (
            WebhookDelivery.objects.select_for_update()
            .select_related("endpoint")
            .filter(pk=delivery_id)
            .first()
        )
        if delivery is None or delivery.status != DeliveryStatus.PENDING:
            return Attempt(delivered=delivery is not None, retry_in_s=None)
        delivery.attempts += 1
        attempt_number = delivery.attempts
        delivery.save(update_fields=["attempts"])
    endpoint = delivery.endpoint
    body = json.dumps(delivery.payload, separators=(",", ":"), sort_keys=True).encode()
    timestamp = int(time.time())
    try:
        secret = decrypt(endpoint.secret_encrypted)
    except ValueError as exc:  # this process's SECRET_KEY is not the one that stored it
        WebhookDelivery.objects.filter(pk=delivery_id).update(status=DeliveryStatus.FAILED, error=str(exc))
        return Attempt(delivered=False, retry_in_s=None)
    request = urllib.request.Request(
        endpoint.url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "artweb-webhooks/1",
            ID_HEADER: delivery.event_id,
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: signature(secret, timestamp, body),
        },
    )
    started = time.monotonic()
    status_code: int | None = None
    error = ""
    refused = False
    try:
        with outbound_policy().opener().open(request, timeout=settings.WEBHOOK_TIMEOUT_S) as response:
            status_code = response.status
            response.read(4096)
    except OutboundRefused as exc:
        error, refused = f"refused by the outbound policy: {exc}", True
    except urllib.error.HTTPError as exc:
        status_code = exc.code
        error = f"HTTP {exc.code}: {upstream_reason(exc.read(4096))}"
    except (urllib.error.URLError, OSError) as exc:
        error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    except (http.client.HTTPException, ValueError) as exc:
        # A garbled reply, or a request http.client cannot write: an error like any other, retried
        # up to the cap, never an exception that leaves the delivery pending with no next attempt.
        error = f"{type(exc).__name__}: {exc}"
    latency_ms = (time.monotonic() - started) * 1000
    delivered = status_code is not None and 200 <= status_code < 300
    give_up = refused or attempt_number >= settings.WEBHOOK_MAX_ATTEMPTS
    now = timezone.now()
    updates: dict[str, Any] = {
        "response_status": status_code, "error": error[:ERROR_LIMIT], "latency_ms": round(latency_ms, 1),
    }  # fmt: skip
    if delivered:
        updates |= {"status": DeliveryStatus.SUCCEEDED, "delivered_at": now, "next_attempt_at": None}
        retry = None
    elif give_up:
        updates |= {"status": DeliveryStatus.FAILED, "next_attempt_at": None}
        retry = None
    else:
        retry = retry_delay(attempt_number)
        updates |= {"next_attempt_at": now + timedelta(seconds=retry)}
    WebhookDelivery.objects.filter(pk=delivery_id).update(**updates)
    return Attempt(delivered=delivered, retry_in_s=retry)
