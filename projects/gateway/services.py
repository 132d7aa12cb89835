"""Writes of the serving side: inference server registration and usage metering.

- A server's heartbeat is an upsert keyed by its URL, so a server whose row was deleted (a clean
  shutdown elsewhere, a wiped table) reappears on its next beat without a restart.
- Usage is one row per (API key, model id, UTC day), incremented with an UPDATE … SET x = x + n,
  so concurrent requests never lose a count; the first request of a day inserts the row, and a
  lost insert race falls back to the update.
"""

from __future__ import annotations

import socket
from datetime import date, datetime

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from projects.errors import NotFound
from projects.models import ApiKey, BaseModel, Checkpoint, InferenceServer, UsageRecord


def inference_server_heartbeat(
    *,
    url: str,
    base_model_name: str,
    engine: str = "transformers",
    capacity: int = 8,
    max_batch_size: int = 32,
    loaded_adapters: list[str] | None = None,
    pid: int | None = None,
    started_at: datetime | None = None,
) -> InferenceServer:
    """Register the server at ``url`` or refresh its heartbeat (the same call does both)."""
    base_model = BaseModel.objects.filter(name=base_model_name).first()
    if base_model is None:
        raise NotFound(f"no base model named {base_model_name!r} in the catalogue")
    now = timezone.now()
    fields = {
        "base_model": base_model,
        "engine": engine,
        "capacity": capacity,
        "max_batch_size": max_batch_size,
        "loaded_adapters": loaded_adapters or [],
        "hostname": socket.gethostname(),
        "pid": pid,
        "heartbeat_at": now,
    }
    server, _ = InferenceServer.objects.update_or_create(
        url=url, defaults=fields, create_defaults={**fields, "started_at": started_at or now}
    )
    return server


def inference_server_deregister(*, url: str) -> None:
    """Called by a server that stops cleanly, so routing stops before its heartbeat expires."""
    InferenceServer.objects.filter(url=url).delete()


def usage_record(
    *,
    api_key: ApiKey,
    model: str,
    checkpoint: Checkpoint | None,
    prompt_tokens: int,
    completion_tokens: int,
    day: date | None = None,
) -> None:
    day = day or timezone.now().date()  # USE_TZ with UTC: the UTC day
    increments = {
        "requests": F("requests") + 1,
        "prompt_tokens": F("prompt_tokens") + prompt_tokens,
        "completion_tokens": F("completion_tokens") + completion_tokens,
    }
    rows = UsageRecord.objects.filter(api_key=api_key, model=model, day=day)
    if rows.update(**increments):
        return
    try:
        with transaction.atomic():
            UsageRecord.objects.create(
                team_id=api_key.team_id,
                api_key=api_key,
                model=model,
                checkpoint=checkpoint,
                day=day,
                requests=1,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            )
    except IntegrityError:  # another request inserted it first
        rows.update(**increments)
