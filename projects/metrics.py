"""Prometheus metrics of the web process, the gateway and the Celery worker (prometheus_client).

Series (all prefixed ``artweb_``):
- web: ``http_request_duration_seconds{route,method,status}`` (the URL pattern, never the raw path);
- gateway: ``gateway_request_duration_seconds{model,status,stream}`` and
  ``gateway_tokens_total{model,kind}`` (``model`` is ``project/model`` without the step, so the
  label set stays small as checkpoints accumulate), ``gateway_upstream_outstanding_requests{server}``
  (completions in flight to each inference server, what the balancer reads);
- worker: ``step_seconds{kind}`` and ``step_phase_seconds{kind,phase}`` (rollout / update),
  ``tokens_total{kind,what}`` (sampled / trained; tokens/s is ``rate()``), ``grader_errors_total``,
  ``jobs_finished_total{kind,outcome}`` (``step_phase_seconds`` phases: rollout, update, sync);
- read from PostgreSQL at each scrape of the web's ``/metrics``: ``work_items{kind,status}`` (runs,
  evaluations, training jobs, exports by state) and ``queue_depth{queue}`` (messages waiting in the
  Redis broker).

Multiprocess-safe: with ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client's own variable; ``make
up`` and the compose file set it, one empty folder per host) every process writes its samples
there and a scrape sums them, so uvicorn workers and Celery's forked pool children are all counted.
``/metrics`` is for the operator: it answers only with ``Authorization: Bearer $METRICS_TOKEN``
(unset: 404), and the worker's own endpoint binds ``METRICS_BIND_ADDRESS:WORKER_METRICS_PORT`` with the
same token (without one: loopback only).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)

HTTP_LATENCY = Histogram(
    "artweb_http_request_duration_seconds", "Web requests by URL pattern", ["route", "method", "status"],
    buckets=LATENCY_BUCKETS,
)  # fmt: skip
GATEWAY_LATENCY = Histogram(
    "artweb_gateway_request_duration_seconds",
    "Gateway chat completions (streams: until the response starts)",
    ["model", "status", "stream"],
    buckets=LATENCY_BUCKETS,
)
GATEWAY_OUTSTANDING = Gauge(
    "artweb_gateway_upstream_outstanding_requests",
    "Completions in flight from this gateway to each inference server",
    ["server"],
    multiprocess_mode="livesum",
)
GATEWAY_TOKENS = Counter("artweb_gateway_tokens_total", "Tokens served by the gateway", ["model", "kind"])
STEP_SECONDS = Histogram("artweb_step_seconds", "Training step wall time", ["kind"], buckets=STEP_BUCKETS)
STEP_PHASE_SECONDS = Histogram(
    "artweb_step_phase_seconds", "Training step time by phase", ["kind", "phase"], buckets=STEP_BUCKETS
)
TOKENS = Counter("artweb_tokens_total", "Tokens sampled and trained by workers", ["kind", "what"])
GRADER_ERRORS = Counter("artweb_grader_errors_total", "Samples a grader failed on", ["kind"])
JOBS_FINISHED = Counter(
    "artweb_jobs_finished_total", "Claimed work finished by a worker", ["kind", "outcome"]
)


def model_label(model_id: str) -> str:
    """``project/model:7`` -> ``project/model``; base model names pass unchanged."""
    return model_id.rsplit(":", 1)[0] if "/" in model_id else model_id


def observe_step(*, kind: str, metrics: dict[str, Any]) -> None:
    """One recorded training step (a run's or a client training job's step metrics)."""

    def number(key: str) -> float | None:
        value = metrics.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    if (seconds := number("step_seconds")) is not None:
        STEP_SECONDS.labels(kind).observe(seconds)
    for phase, key in (("rollout", "rollout_seconds"), ("update", "train_seconds"), ("sync", "sync_seconds")):
        if (value := number(key)) is not None:
            STEP_PHASE_SECONDS.labels(kind, phase).observe(value)
    for what, key in (("sampled", "completion_tokens"), ("trained", "trainable_tokens")):
        if (value := number(key)) is not None:
            TOKENS.labels(kind, what).inc(value)
    if (errors := number("grader_errors")) is not None and errors > 0:
        GRADER_ERRORS.labels(kind).inc(errors)


# --- what PostgreSQL and the broker know, read at scrape time ------------------------------------


class StateCollector(Collector):
    """Work items by state and broker queue depth, read when scraped (never cached)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from django.db.models import Count

        from projects.models import Evaluation, Export, Run, TrainingJob

        items = GaugeMetricFamily(
            "artweb_work_items", "Runs, evaluations, jobs by state", labels=["kind", "status"]
        )
        for kind, model in (
            ("run", Run),
            ("evaluation", Evaluation),
            ("training_job", TrainingJob),
            ("export", Export),
        ):
            for row in model.objects.values("status").annotate(n=Count("id")).order_by():
                items.add_metric([kind, row["status"]], row["n"])
        yield items
        depth = GaugeMetricFamily("artweb_queue_depth", "Messages waiting in the broker", labels=["queue"])
        for queue, waiting in queue_depths().items():
            depth.add_metric([queue], waiting)
        yield depth


def queue_depths() -> dict[str, int]:
    """Messages waiting per work queue, for a Redis broker (kombu keeps a queue as a list named
    after it); empty for other brokers."""
    broker = settings.CELERY_BROKER_URL
    if not broker.startswith(("redis://", "rediss://")):
        return {}
    import redis

    from projects.queues import Queue

    names = {queue.value for queue in Queue} | {settings.WORK_QUEUE_DEFAULT}
    try:
        client = redis.Redis.from_url(broker, socket_timeout=1)
        return {name: int(client.llen(name)) for name in sorted(names)}
    except redis.RedisError as exc:
        logger.warning("queue depth unavailable: %s", exc)
        return {}


class _ThisProcess(Collector):
    """The default registry's samples, read through another registry (the default one itself
    never gets the database-reading StateCollector: other code scrapes it without a database)."""

    def collect(self) -> Iterator[Any]:
        yield from REGISTRY.collect()


def registry(*, with_state: bool = True) -> CollectorRegistry:
    """What a scrape reads: every process's samples in multiprocess mode, else this process's;
    plus, for the web only (``with_state``), what PostgreSQL and the broker know, so that those
    series come from one scrape target and a dashboard's sum does not count them twice."""
    combined = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(combined)
    else:
        combined.register(_ThisProcess())
    if with_state:
        combined.register(StateCollector())
    return combined


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``GET /metrics`` with the operator's token; 404 when no token is configured (not public)."""
    token = settings.METRICS_TOKEN
    if not token:
        raise Http404("metrics are off: set METRICS_TOKEN")
    given = request.headers.get("Authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return HttpResponse(
            "metrics need Authorization: Bearer $METRICS_TOKEN\n", status=401, content_type="text/plain"
        )
    return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


_GROUP = re.compile(r"\(\?P<([^>]+)>[^)]*\)")


def route_label(route: str) -> str:
    """A URL pattern as a label: ``api/v1/runs/(?P<pk>[^/.]+)/$`` (the router's regex) and
    ``api/v1/runs/<int:run_id>/`` both read ``/api/v1/runs/<pk>/``-style, never an id."""
    route = _GROUP.sub(lambda m: f"<{m.group(1)}>", route).lstrip("^").rstrip("$")
    route = re.sub(r"<(?:\w+:)?(\w+)>", r"<\1>", route)
    return "/" + route.lstrip("/")


class MetricsMiddleware:
    """Request latency by URL pattern and status (second in MIDDLEWARE, after the request id)."""

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> Any:
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        route = route_label(match.route) if match is not None and match.route else "unmatched"
        HTTP_LATENCY.labels(route, request.method or "", str(response.status_code)).observe(
            time.perf_counter() - started
        )
        return response


def start_worker_metrics_server() -> WSGIServer | None:
    """The worker's ``/metrics`` on METRICS_BIND_ADDRESS:WORKER_METRICS_PORT (0: off), served by a
    daemon thread (the server is returned; ``shutdown()`` stops it). With METRICS_TOKEN set it answers only "Bearer $METRICS_TOKEN", like the web's; without
    one it serves on a loopback address only (elsewhere it stays off, with an error in the log)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app

    from training.serving.binding import is_loopback

    port = settings.WORKER_METRICS_PORT
    if not port:
        return None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Tasks run in forked pool children: without the shared folder their samples never reach
        # the parent that serves /metrics, and the endpoint would show zeros that look like data.
        logger.error("WORKER_METRICS_PORT is set but PROMETHEUS_MULTIPROC_DIR is not: worker metrics are off")
        return None
    address, token = settings.METRICS_BIND_ADDRESS, settings.METRICS_TOKEN
    if not token and not is_loopback(address):
        logger.error(
            "worker metrics are off: METRICS_BIND_ADDRESS %s is not loopback and METRICS_TOKEN is unset",
            address,
        )
        return None
    metrics_app = make_wsgi_app(registry(with_state=False))

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        given = environ.get("HTTP_AUTHORIZATION", "")
        if token and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            start_response("401 Unauthorized", [("Content-Type", "text/plain")])
            return [b"metrics need Authorization: Bearer $METRICS_TOKEN\n"]
        return metrics_app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            pass

    server = make_server(address, port, guarded, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="worker-metrics", daemon=True).start()
    logger.info("worker metrics on http://%s:%d/metrics", address, port)
    return server
