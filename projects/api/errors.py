"""One error handler: every error is an OpenAI-style error object.

``{"error": {"message": ..., "type": ..., "param": <field or null>, "code": ..., "fields": {...}}}``
— ``param`` names the (first) offending field, ``fields`` maps every bad field to its reasons.
The ``type`` of each status comes from the table the gateway and inference server share
(training.wire.openai_errors).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from projects.errors import DomainError, ValidationFailed
from training.safety.slots import SlotsBusy
from training.wire.openai_errors import error_object


def _flatten(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """Turn DRF's nested error detail into {"field.sub": [reasons]}."""
    out: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = str(key) if key != "non_field_errors" else ""
            path = f"{prefix}.{name}" if prefix and name else (prefix or name)
            out.update(_flatten(value, path))
    elif isinstance(detail, list):
        if all(not isinstance(item, dict | list) for item in detail):
            out.setdefault(prefix or "non_field_errors", []).extend(str(item) for item in detail)
        else:
            for index, item in enumerate(detail):
                out.update(_flatten(item, f"{prefix}[{index}]"))
    else:
        out.setdefault(prefix or "non_field_errors", []).append(str(detail))
    return out


def error_response(
    status_code: int,
    message: str,
    *,
    code: str,
    param: str | None = None,
    fields: dict | None = None,
    headers=None,
) -> Response:
    body = error_object(status_code, message, code=code, param=param)
    if fields:
        body["error"]["fields"] = fields
    return Response(body, status=status_code, headers=headers)


def exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, ValidationFailed):
        fields: dict[str, list[str]] = {}
        for field, message in exc.problems:
            fields.setdefault(field, []).append(message)
        return error_response(exc.status_code, str(exc), code=exc.code, param=exc.field, fields=fields)
    if isinstance(exc, DomainError):
        return error_response(exc.status_code, exc.message, code=exc.code, param=exc.field)
    if isinstance(exc, SlotsBusy):  # the host's sandbox caps (training.safety.slots): come back shortly
        return error_response(
            status.HTTP_429_TOO_MANY_REQUESTS,
            str(exc),
            code="sandbox_busy",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if isinstance(exc, exceptions.ValidationError):
        fields = _flatten(exc.detail)
        param, reasons = next(iter(fields.items()))
        message = f"{param}: {reasons[0]}" if param != "non_field_errors" else reasons[0]
        return error_response(
            status.HTTP_400_BAD_REQUEST, message, code="invalid", param=param, fields=fields
        )
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    detail = getattr(exc, "detail", None)
    message = str(detail) if detail is not None else str(exc)
    code = getattr(detail, "code", None) or getattr(exc, "default_code", "error")
    result = error_response(response.status_code, message, code=str(code))
    for header in ("WWW-Authenticate", "Retry-After", "Allow"):
        if header in response:
            result[header] = response[header]
    return result
