"""`manage.py demo` on the embedded defaults: SQLite + the filesystem broker, no external service."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def embedded_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "CELERY_BROKER_URL"}}
    env.update({"ARTWEB_DATA_DIR": str(data_dir), "DEBUG": "1", "TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return env


def run_demo(data_dir: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "demo", *args],
        cwd=ROOT, env=embedded_env(data_dir), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_demo_runs_on_embedded_defaults_with_the_tiny_model(tmp_path, tiny_model_dir):
    data_dir = tmp_path / "data"
    result = run_demo(
        data_dir, "--steps", "2", "--base-model", str(tiny_model_dir), "--group-size", "4", "--groups-per-step", "2",
        "--max-new-tokens", "8", timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "succeeded: 2 steps" in result.stdout
    assert "API key for team 'demo': aw_" in result.stdout
    with sqlite3.connect(data_dir / "artweb.sqlite3") as db:
        assert db.execute("select status from projects_run").fetchall() == [("succeeded",)]
        assert db.execute("select count(*) from projects_stepmetrics").fetchone() == (2,)
    # A second demo reuses the team (no new key printed) and trains a fresh model.
    again = run_demo(
        data_dir, "--steps", "1", "--base-model", str(tiny_model_dir), "--max-new-tokens", "4", timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "API key" not in again.stdout


def test_demo_exits_nonzero_when_the_run_fails(tmp_path):
    result = run_demo(
        tmp_path / "data", "--steps", "1", "--base-model", str(tmp_path / "missing"), timeout=300
    )
    assert result.returncode != 0
    assert "failed" in (result.stdout + result.stderr)


@pytest.mark.slow
def test_demo_trains_the_bundled_model(tmp_path):
    result = run_demo(tmp_path / "data", "--steps", "2", timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
