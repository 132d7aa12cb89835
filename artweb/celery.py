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


@signals.worker_init.connect
def _fresh_metrics_folder(**kwargs: Any) -> None:
    """prometheus_client's multiprocess folder must exist and hold no earlier run's samples: made
    here, in the main process before the pool forks, and cleared of files whose process is gone
    (``<kind>_<pid>.db``; a live web process sharing the folder keeps its own)."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder:
        return
    from pathlib import Path

    Path(folder).mkdir(parents=True, exist_ok=True)
    for sample_file in Path(folder).glob("*_*.db"):
        pid = sample_file.stem.rsplit("_", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            sample_file.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@signals.worker_ready.connect
def _serve_worker_metrics(**kwargs: Any) -> None:
    """The worker's Prometheus endpoint (projects.metrics), when WORKER_METRICS_PORT is set."""
    from projects.metrics import start_worker_metrics_server

    start_worker_metrics_server()
