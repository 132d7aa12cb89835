"""The ids a log line belongs to (request, run, evaluation, training job), bound where the work is.

``log_context(run_id=3)`` binds fields for the code inside it (a contextvar: per thread and per
asyncio task, so concurrent requests never see each other's ids). The web process binds
``request_id`` (projects.middleware), the worker binds ``run_id`` / ``evaluation_id`` /
``training_job_id`` while it works on one (projects.jobs.claimed). How they are written (the
console handler's filter, text or JSON lines) is the deployment's choice: artweb.logs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "artweb_log_context", default=_EMPTY
)


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Bind ``fields`` (added to what is bound already) to every log line written inside."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> contextvars.Token[Mapping[str, Any]]:
    """``log_context`` for code that cannot use a ``with`` block; undo with ``unbind(token)``."""
    return _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})


def unbind(token: contextvars.Token[Mapping[str, Any]]) -> None:
    _context.reset(token)


def current_context() -> dict[str, Any]:
    return dict(_context.get())
