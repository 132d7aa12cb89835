"""Real processes for the gateway's integration tests: inference servers (`manage.py
serve_inference`) on the tiny model and the web app under uvicorn, all on the pytest-django test
database (PostgreSQL, or the SQLite file of `make test`'s second pass), which the tests use
through transactional tests so rows are visible across processes. The processes live for one test
module; each test re-creates the rows it needs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.processes import Process, test_database_url

ROOT = Path(__file__).resolve().parents[3]
BASE_MODEL = "gateway-tiny"  # not "tiny": other tests' fixtures register a base model by that name
SERVER_TOKEN = "test-server-token"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Serving:
    """Environment shared by the processes of one module."""

    data_dir: Path
    env: dict[str, str]
    processes: list[Process]

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"

    def start(
        self, name: str, command: list[str], ready: Callable[[Process], bool], **extra_env: str
    ) -> Process:
        log = self.data_dir / f"{name}-{len(self.processes)}.log"
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                command, cwd=ROOT, env={**self.env, **extra_env}, stdout=handle, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        started = Process(name, process, log)
        self.processes.append(started)
        deadline = time.monotonic() + 180  # two shared cores: torch imports slowly under load
        while not ready(started):
            if process.poll() is not None or time.monotonic() > deadline:
                started.kill()
                pytest.fail(f"{name} did not start:\n{started.output()[-3000:]}")
            time.sleep(0.2)
        return started

    def start_inference_server(self, base_model: str = BASE_MODEL) -> Process:
        def ready(process: Process) -> bool:
            for line in process.output().splitlines():
                if line.startswith("inference server for ") and " on " in line:
                    process.url = line.rsplit(" on ", 1)[1].strip()
                    return True
            return False

        command = [sys.executable, "manage.py", "serve_inference", "--base-model", base_model, "--port", "0"]
        return self.start(f"inference-{base_model}", command, ready)

    def start_gateway(self, **extra_env: str) -> Process:
        port = free_port()
        command = [sys.executable, "-m", "uvicorn", "artweb.asgi:application", "--port", str(port),
                   "--log-level", "warning"]  # fmt: skip

        def ready(process: Process) -> bool:
            process.url = f"http://127.0.0.1:{port}"
            try:
                with urllib.request.urlopen(f"{process.url}/healthz", timeout=2):
                    return True
            except OSError:
                return False

        return self.start("gateway", command, ready, **extra_env)


@pytest.fixture(scope="module")
def serving(django_db_setup, django_db_blocker, tiny_model_dir, tmp_path_factory) -> Iterator[Serving]:
    data_dir = tmp_path_factory.mktemp("serving")
    with django_db_blocker.unblock():
        env = {
            **os.environ,
            "DATABASE_URL": test_database_url(),
            "ARTWEB_DATA_DIR": str(data_dir),
            "DEBUG": "1",
            "TORCH_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "INFERENCE_SERVER_TOKEN": SERVER_TOKEN,
            # This process's: the adapter names the gateway derives from it are the tests' to compute.
            "SECRET_KEY": settings.SECRET_KEY,
            "INFERENCE_HEARTBEAT_INTERVAL_S": "0.5",
            "INFERENCE_HEARTBEAT_TIMEOUT_S": "3",
            "INFERENCE_BATCH_WINDOW_MS": "20",
            "GATEWAY_RATE_LIMIT_PER_MINUTE": "0",
            "GATEWAY_RETRY_AFTER_S": "2",
        }
        register_base_model(tiny_model_dir)  # the server checks it exists when it starts
    serving = Serving(data_dir, env, [])
    yield serving
    for process in serving.processes:
        process.stop()


def register_base_model(tiny_model_dir: Path, name: str = BASE_MODEL) -> None:
    from projects import services

    services.base_model_register(name=name, source=str(tiny_model_dir))


@pytest.fixture(scope="module")
def inference_server(serving) -> Process:
    return serving.start_inference_server()


@pytest.fixture(scope="module")
def gateway(serving, inference_server) -> Process:
    return serving.start_gateway()


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def http(method: str, url: str, *, key: str | None = None, body: Any = None) -> tuple[int, dict, Any]:
    """(status, headers, decoded JSON body) of a plain HTTP call; errors are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read() or b"null")


def server_stats(server: Process) -> dict:
    return http("GET", f"{server.url}/stats", key=SERVER_TOKEN)[2]
