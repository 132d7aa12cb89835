"""The Celery application. Queues are named from one enum in projects.queues."""

import logging
import os
from typing import Any

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "artweb.settings")

app = Celery("artweb")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["projects.jobs"])  # projects/jobs/tasks.py


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _log_with_context(logger: logging.Logger, *args: Any, **kwargs: Any) -> None:
    """The worker's log lines in the settings' LOG_FORMAT, with the run / evaluation / job id bound
    while it works (artweb.logs); Celery keeps its own handlers and --loglevel."""
    from django.conf import settings

    from artweb.logs import ContextFilter, JsonFormatter, TextFormatter

    formatter = JsonFormatter() if settings.LOG_FORMAT == "json" else TextFormatter()
    for handler in logger.handlers:
        handler.addFilter(ContextFilter())
        handler.setFormatter(formatter)


@signals.worker_ready.connect
def _serve_worker_metrics(**kwargs: Any) -> None:
    """The worker's Prometheus endpoint (projects.metrics), when WORKER_METRICS_PORT is set."""
    from projects.metrics import start_worker_metrics_server

    start_worker_metrics_server()
