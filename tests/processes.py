"""Helpers for tests that run real processes (Celery workers, inference servers, uvicorn) against
the pytest-django test database."""

from __future__ import annotations

import os
import signal
import subprocess
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
