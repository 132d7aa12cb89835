"""The one-host stack (`manage.py up`, `manage.py demo`) serves every queue work can be routed to,
and gives its processes one shared folder for Prometheus samples."""

from __future__ import annotations

import pytest

from artweb import stack
from projects import services

pytestmark = pytest.mark.django_db


def test_the_worker_consumes_the_default_queues_and_every_base_models_own(settings):
    settings.WORK_QUEUE_DEFAULT = "cpu"
    services.base_model_register(name="big", source="org/big", queue="gpu-large")
    services.base_model_register(name="small", source="org/small")
    command = stack.worker_command()
    queues = command[command.index("-Q") + 1].split(",")
    assert queues == ["cpu", "default", "gpu-large", "train"]


def test_children_share_an_emptied_prometheus_folder(settings, tmp_path, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    settings.DATA_DIR = tmp_path
    (tmp_path / "prometheus").mkdir()
    (tmp_path / "prometheus" / "counter_123.db").write_bytes(b"stale")
    started = stack.Stack(tmp_path / "logs")
    assert started.env["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path / "prometheus")
    assert list((tmp_path / "prometheus").iterdir()) == []
