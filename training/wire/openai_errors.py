"""OpenAI's error object and the one table of its error types, by HTTP status.

Every error artweb answers is ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape,
https://platform.openai.com/docs/guides/error-codes): the REST API (projects.api.errors), the
gateway (projects.gateway.errors) and the inference server (training.serving) all build it with
`error_object`, so a status means the same `type` everywhere. It lives here, not in ``projects``,
because the inference server must not import Django. Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorKind:
    type: str  # OpenAI's error `type` for the status
    code: str  # the `code` when whoever raises the error names none


ERROR_KINDS: dict[int, ErrorKind] = {
    400: ErrorKind("invalid_request_error", "invalid_request"),
    401: ErrorKind("authentication_error", "invalid_api_key"),
    403: ErrorKind("permission_error", "permission_denied"),
    404: ErrorKind("not_found_error", "not_found"),
    405: ErrorKind("invalid_request_error", "method_not_allowed"),
    406: ErrorKind("invalid_request_error", "not_acceptable"),
    409: ErrorKind("conflict_error", "conflict"),
    413: ErrorKind("invalid_request_error", "body_too_large"),
    415: ErrorKind("invalid_request_error", "unsupported_media_type"),
    429: ErrorKind("rate_limit_error", "rate_limit_exceeded"),
    500: ErrorKind("api_error", "server_error"),
    502: ErrorKind("api_error", "upstream_error"),
    503: ErrorKind("api_error", "no_server_available"),
    504: ErrorKind("api_error", "upstream_timeout"),
}
# Any other status (e.g. one a vLLM server answers with) is the server's fault as far as the
# client can tell.
OTHER_ERROR = ErrorKind("api_error", "server_error")


def error_kind(status: int) -> ErrorKind:
    return ERROR_KINDS.get(status, OTHER_ERROR)


def error_object(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for an error answered with HTTP ``status``."""
    kind = error_kind(status)
    return {
        "error": {
            "message": message,
            "type": kind.type,
            "param": param,
            "code": kind.code if code is None else code,
        }
    }


def error_message(body: bytes) -> str:
    """The message of an upstream's error body: OpenAI's ``{"error": {"message"}}`` or vLLM's older
    ``{"object": "error", "message"}``; "" when the body is not JSON or names no message."""
    try:
        decoded = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return ""
    if isinstance(decoded, dict):
        inner = decoded["error"] if isinstance(decoded.get("error"), dict) else decoded
        if isinstance(inner.get("message"), str):
            return str(inner["message"])
    return ""
