"""deploy/: the Prometheus scrape configuration and the Grafana dashboard refer only to series
artweb exports (projects.metrics, training.serving.metrics), and scrape every process that has any."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import Counter, Gauge, Histogram

from projects import metrics as web_metrics
from training.serving import metrics as serving_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
STATE_SERIES = {"artweb_work_items", "artweb_queue_depth"}  # the scrape-time collector's


def exported_series() -> set[str]:
    names = set(STATE_SERIES)
    for module in (web_metrics, serving_metrics):
        for value in vars(module).values():
            if isinstance(value, Counter):
                names.add(f"{value._name}_total")
            elif isinstance(value, Histogram):
                names |= {f"{value._name}_{part}" for part in ("bucket", "sum", "count")}
            elif isinstance(value, Gauge):
                names.add(value._name)
    return names


def test_every_series_the_dashboard_queries_exists():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bartweb_[a-z0-9_]+", target["expr"])
    }
    assert queried, "the dashboard queries nothing"
    missing = queried - exported_series()
    assert not missing, f"the dashboard queries series nobody exports: {sorted(missing)}"
    # Every exported family is on some panel.
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in queried}
    unused = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported_series()} - families
    assert not unused, f"exported but on no panel: {sorted(unused)}"


def test_the_scrape_config_covers_web_worker_and_inference():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"artweb-web", "artweb-worker", "artweb-inference"}
    assert jobs["artweb-web"]["authorization"]["type"] == "Bearer"  # METRICS_TOKEN
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())
