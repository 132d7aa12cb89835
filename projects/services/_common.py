"""Helpers every service module uses: names users put in URLs, unique-name races, deletes that
runs protect, text that PostgreSQL can store (and how long free text may be), and the reason
claimed work gives up on workers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import ProtectedError

from projects.errors import Conflict, ValidationFailed
from projects.models import Evaluation, Run, slug_validator
from training.config import ConfigError, TrainConfig
from training.rollouts import strict_json

T = TypeVar("T")


def check_slug(value: str, field: str) -> None:
    """A name users put in URLs and model ids (``project/model:step``): ValidationFailed on ``field``
    unless it is a slug. Shared by every service that names things (scenarios too)."""
    try:
        slug_validator(value)
    except ValidationError as exc:
        raise ValidationFailed(exc.messages[0], field=field) from exc


def check_storable(value: Any, *, field: str) -> None:
    """ValidationFailed naming the path under ``field`` unless ``value`` is JSON that PostgreSQL can
    store and every reader can render again: training.rollouts.strict_json's rules (no NaN or infinite
    numbers, integers within 64 bits, no lone surrogates, no NUL, nesting at most 64 deep). For
    values that did not come through the strict parser (the dashboard, generated rows, code)."""
    try:
        strict_json.check(value, allow_nul=False, path=field)
    except strict_json.JSONError as exc:
        raise ValidationFailed(exc.message, field=exc.path or field) from None


def check_devices(value: Any, *, field: str) -> int:
    """A count of devices to train on, data-parallel on one host (TrainConfig's ``devices`` bounds)."""
    bounds = next(f.metadata["bounds"] for f in dataclasses.fields(TrainConfig) if f.name == "devices")
    if isinstance(value, bool) or not isinstance(value, int) or bounds.problem(value):
        raise ValidationFailed(f"must be a whole number of devices from {bounds.minimum:g} to {bounds.maximum:g} "
                               f"(data-parallel training on one host), not {value!r}", field=field)  # fmt: skip
    return value


def check_fsdp(fsdp: bool, devices: int, *, field: str) -> bool:
    """``fsdp`` (the base sharded across ``devices``, already checked) under TrainConfig's own rule
    for it, its problem a 400 on ``field``."""
    try:
        TrainConfig(devices=devices, fsdp=fsdp)
    except ConfigError as exc:
        problem = next((message for name, message in exc.problems if name == "fsdp"), None)
        if problem is not None:
            raise ValidationFailed(problem, field=field) from exc
        raise
    return fsdp


def check_text_length(value: Any, *, field: str, max_chars: int) -> None:
    """ValidationFailed on ``field`` when the text ``value`` is longer than ``max_chars``: every
    free-text field has a stated maximum (a TextField has none in PostgreSQL, so a 3 MB project
    description was stored). Values that are not text are left to the caller's own checks."""
    if isinstance(value, str) and len(value) > max_chars:
        raise ValidationFailed(f"must be at most {max_chars} characters (got {len(value)})", field=field)


def json_text_read(text: str | bytes, *, field: str = "") -> Any:
    """JSON a person typed (the dashboard's text areas) read by the API's strict reader
    (training.rollouts.strict_json); ValidationFailed "not valid JSON: … (line, column)" on ``field``."""
    try:
        return strict_json.loads(text, allow_nul=False)
    except strict_json.JSONError as exc:
        where = f" (line {exc.line}, column {exc.column})" if exc.line is not None else ""
        raise ValidationFailed(f"not valid JSON: {exc.message}{where}", field=field or None) from None


def config_invalid(exc: ConfigError, prefix: str = "") -> ValidationFailed:
    """A 400 listing every problem of a training.config ConfigError, each field under ``prefix``
    (``config.``, ``sampling.``, ``lora.``), so a form shows them all at once."""
    problems = [(f"{prefix}{field}", message) for field, message in exc.problems]
    summary = "; ".join(f"{field}: {message}" for field, message in problems)
    return ValidationFailed(
        summary if len(problems) > 1 else exc.message, field=problems[0][0], problems=problems
    )


def create_unique(create: Callable[[], T], *, field: str, message: str) -> T:
    """Run a create inside a savepoint, turning a unique-constraint race into a clear 400."""
    try:
        with transaction.atomic():
            return create()
    except IntegrityError as exc:
        raise ValidationFailed(message, field=field) from exc


def delete_unless_used(instance: Any, what: str) -> None:
    """Delete ``instance``; a 409 ``in_use`` when runs still protect it."""
    try:
        instance.delete()
    except ProtectedError as exc:
        raise Conflict(f"this {what} is used by runs; delete those first", code="in_use") from exc


def jsonb_safe(value: Any) -> Any:
    """PostgreSQL text and jsonb cannot hold NUL characters, but a model can sample one: replace it
    (U+FFFD) rather than lose the whole step."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {jsonb_safe(k): jsonb_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonb_safe(v) for v in value]
    return value


def error_text(error: str, *, limit: int = 2000) -> str:
    """A failure's message as stored on the row and in its event: cut at ``limit`` characters."""
    return error if len(error) <= limit else error[:limit] + "…"


def worker_lost_reason(work: Run | Evaluation) -> str:
    """Why claimed work whose worker keeps dying is failed instead of taken over once more."""
    seen = work.heartbeat_at.isoformat(timespec="seconds") if work.heartbeat_at else "an unknown time"
    return f"worker lost {work.attempts} times; last seen on {work.worker or '?'} at {seen}"
