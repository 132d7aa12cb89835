"""Writes of the serving side: inference server registration and usage metering.

- A vLLM server's ``loaded_adapters`` is the gateway's record of the adapters it loaded there,
  least recently used first, changed only under ``select_for_update`` of the server's row.
- A server's heartbeat is an upsert keyed by its URL, so a server whose row was deleted (a clean
  shutdown elsewhere, a wiped table) reappears on its next beat without a restart.
- Usage is one row per (API key, model id, UTC day), incremented with an UPDATE … SET x = x + n,
  so concurrent requests never lose a count; the first request of a day inserts the row, and a
  lost insert race falls back to the update.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
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
    fetch_url: str = "",
) -> InferenceServer:
    """Register the server at ``url`` or refresh its heartbeat (the same call does both).

    ``loaded_adapters=None`` leaves the recorded list as it is (a new row starts empty): a vLLM
    server's list is kept by the gateway, which loads the adapters (``inference_server_adapter_use``).
    """
    base_model = BaseModel.objects.filter(name=base_model_name).first()
    if base_model is None:
        raise NotFound(f"no base model named {base_model_name!r} in the catalogue")
    now = timezone.now()
    fields = {
        "base_model": base_model,
        "engine": engine,
        "capacity": capacity,
        "max_batch_size": max_batch_size,
        "hostname": socket.gethostname(),
        "pid": pid,
        "heartbeat_at": now,
        "fetch_url": fetch_url,
    }
    if loaded_adapters is not None:
        fields["loaded_adapters"] = loaded_adapters
    create = {"loaded_adapters": [], **fields, "started_at": started_at or now}
    server, _ = InferenceServer.objects.update_or_create(url=url, defaults=fields, create_defaults=create)
    return server


@dataclass(frozen=True)
class AdapterUse:
    """What the gateway must do on a vLLM server before a request for adapter ``name``."""

    load: bool  # not recorded as loaded there: load it
    evict: list[str]  # least recently used adapters pushed out by it: unload them first


def inference_server_adapter_use(*, server_id: int, name: str) -> AdapterUse:
    """Record that adapter ``name`` is (about to be) loaded on the server and is its most recently
    used; beyond the server's capacity the least recently used names are dropped and returned.
    Under ``select_for_update``, so concurrent requests (any gateway process) agree on the list."""
    with transaction.atomic():
        server = InferenceServer.objects.select_for_update().filter(pk=server_id).first()
        if server is None:
            return AdapterUse(load=True, evict=[])  # deregistered meanwhile: load, record nothing
        names = [n for n in server.loaded_adapters if isinstance(n, str)]
        load = name not in names
        if not load and names[-1] == name:
            return AdapterUse(load=False, evict=[])
        names = [n for n in names if n != name] + [name]
        keep = max(1, server.capacity)
        evict, names = names[:-keep], names[-keep:]
        server.loaded_adapters = names
        server.save(update_fields=["loaded_adapters"])
        return AdapterUse(load=load, evict=evict)


def inference_server_adapter_forget(*, server_id: int, names: list[str]) -> None:
    """Drop ``names`` from the server's loaded list (a load that failed, an adapter vLLM lost)."""
    with transaction.atomic():
        server = InferenceServer.objects.select_for_update().filter(pk=server_id).first()
        if server is None:
            return
        kept = [n for n in server.loaded_adapters if n not in names]
        if kept != server.loaded_adapters:
            server.loaded_adapters = kept
            server.save(update_fields=["loaded_adapters"])


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
