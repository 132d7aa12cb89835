"""Domain errors raised by services; the API's error handler maps each to one HTTP status.
A class's default ``code`` is its status's in the shared OpenAI error table (training.wire.openai_errors)."""

from __future__ import annotations

from training.wire.openai_errors import error_kind


class DomainError(Exception):
    status_code = 400
    code = error_kind(status_code).code  # "invalid_request"

    def __init__(self, message: str, *, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code:
            self.code = code

    def __str__(self) -> str:
        return _located(self.field, self.message)


class ValidationFailed(DomainError):
    """Bad input. ``problems`` lists every ``(field, message)`` found, not only the first."""

    status_code = 400
    code = "invalid"

    def __init__(
        self, message: str, *, field: str | None = None, problems: list[tuple[str, str]] | None = None
    ):
        super().__init__(message, field=field)
        self.problems = problems or [(field or "non_field_errors", message)]


def _located(field: str | None, message: str) -> str:
    # The path once: a summary of several problems already starts with the first one's path
    # ("grader.pattern: is required", not "grader.pattern: grader.pattern: is required").
    if not field or field == "non_field_errors" or message.startswith(f"{field}: "):
        return message
    return f"{field}: {message}"


class Forbidden(DomainError):
    """The caller may see the thing but not do this to it (e.g. a non-owner managing members)."""

    status_code = 403
    code = error_kind(status_code).code  # "permission_denied"


class NotFound(DomainError):
    status_code = 404
    code = error_kind(status_code).code  # "not_found"


class Conflict(DomainError):
    status_code = 409
    code = error_kind(status_code).code  # "conflict"


class InvalidTransition(Conflict):
    code = "invalid_transition"


class RateLimited(DomainError):
    """The team has as much queued as it may have (a fair share of a shared trainer): try again
    in ``retry_after_s`` seconds (the ``Retry-After`` header)."""

    status_code = 429
    code = error_kind(status_code).code  # "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s
