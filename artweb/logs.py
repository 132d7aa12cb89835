"""Log lines that say which request, run, evaluation or training job they belong to.

The ids are bound where the work is (``log_context(run_id=3)``, projects.logs: a contextvar, per
thread and per asyncio task, so concurrent requests never see each other's ids); a filter on the
console handler copies them onto every record. ``LOG_FORMAT=json`` writes one JSON object per line
(``ts``, ``level``, ``logger``, ``message``, the bound ids, ``exc_info`` when there is a traceback)
for a log pipeline; the default text format appends the ids as ``key=value``. The web process binds
``request_id`` (projects.middleware), the worker binds ``run_id`` / ``evaluation_id`` /
``training_job_id`` while it works on one (projects.jobs.claimed).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from projects.logs import current_context

__all__ = [
    "ContextFilter",
    "JsonFormatter",
    "TextFormatter",
    "logging_config",
]


class ContextFilter(logging.Filter):
    """Copies the bound fields onto the record (``record.context``); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.context = {**current_context(), **getattr(record, "context", {})}
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = getattr(record, "context", None) or {}
        if not context:
            return line
        fields = " ".join(f"{key}={context[key]}" for key in sorted(context))
        head, _, rest = line.partition("\n")  # a traceback stays below the line
        return f"{head} [{fields}]" + (f"\n{rest}" if rest else "")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a value JSON cannot write is written as its ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **(getattr(record, "context", None) or {}),
        }
        if record.exc_info:
            body["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            body["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(body, default=str, ensure_ascii=False)


def logging_config(*, log_format: str, level: str) -> dict[str, Any]:
    """Django's LOGGING for the chosen format (settings: ``LOG_FORMAT`` text | json, ``LOG_LEVEL``)."""
    if log_format not in ("text", "json"):
        raise ValueError(f"LOG_FORMAT must be text or json, not {log_format!r}")
    formatter = "artweb.logs.JsonFormatter" if log_format == "json" else "artweb.logs.TextFormatter"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": "artweb.logs.ContextFilter"}},
        "formatters": {"main": {"()": formatter}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "main", "filters": ["context"]}
        },
        "root": {"handlers": ["console"], "level": level},
    }
