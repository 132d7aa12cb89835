"""Helpers for tests that run real processes (Celery workers, inference servers, uvicorn) against
the pytest-django test database."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[1]


def test_database_url() -> str:
    """A DATABASE_URL for child processes pointing at the test database: PostgreSQL's, or SQLite's
    file (tests/conftest.py puts SQLite's test database in a file; an in-memory one cannot be
    shared)."""
    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.sqlite3" and Path(db["NAME"]).is_absolute():
        return f"sqlite:///{db['NAME']}"
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.fail("these tests need DATABASE_URL on PostgreSQL or an SQLite file (make test sets it)")
    password = f":{db['PASSWORD']}" if db["PASSWORD"] else ""
    return f"postgres://{db['USER'] or 'postgres'}{password}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


test_database_url.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@dataclass
class Process:
    """A child started in its own process group, with its output in ``log``."""

    name: str
    process: subprocess.Popen
    log: Path
    url: str = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the whole group, like a lost machine: no cleanup, no deregistration."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_web(tmp_path: Path, **env: str) -> Process:
    """The web (``uvicorn artweb.asgi:application``) on the test database, answering /healthz; ``env``
    adds settings. The caller stops or kills it."""
    port = free_port()
    environment = {**os.environ, "DATABASE_URL": test_database_url(), "ARTWEB_DATA_DIR": str(tmp_path),
                   "DEBUG": "1", **env}  # fmt: skip
    log = tmp_path / "uvicorn.log"
    command = [sys.executable, "-m", "uvicorn", "artweb.asgi:application", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    with open(log, "wb") as handle:
        child = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=handle, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    process = Process("uvicorn", child, log, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{process.url}/healthz", timeout=2):
                return process
        except OSError:
            if child.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"uvicorn did not start:\n{process.output()[-3000:]}")
            time.sleep(0.2)
