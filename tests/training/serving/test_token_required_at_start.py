"""The trainer service and the standalone inference server refuse to start without their token
(issue 51), unless told they are a developer's, on loopback (``--dev-no-token`` with a loopback
``--host``); then they start and serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRAINER_SERVICE_TOKEN", "INFERENCE_SERVER_TOKEN")}  # fmt: skip
    return {**env, "OMP_NUM_THREADS": "1", "TORCH_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def trainer_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "training.hosting.service", "--root", str(tmp_path), "--port", "0", *extra]


def standalone_argv(tiny_model_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "training.serving.standalone", "--model", str(tiny_model_dir),
            "--cache-dir", str(tiny_model_dir.parent), "--adapter-root", str(tmp_path), "--threads", "1",
            *extra]  # fmt: skip


def refused(argv: list[str]) -> str:
    result = subprocess.run(argv, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    return result.stderr


def started(argv: list[str], announcement: str, **env: str) -> None:
    """Start the server, wait for its line, then check /health answers and a guarded route does
    too (no token needed: the developer's server); stop it."""
    process = subprocess.Popen(argv, cwd=ROOT, env=environment(**env), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 120
        line = process.stdout.readline()
        while not line.startswith(announcement):
            assert line and time.monotonic() < deadline, line + process.stdout.read()
            line = process.stdout.readline()
        url = line.split()[-1]
        assert url.startswith("http://127.0.0.1:"), url
        for path in ("/health", "/stats"):
            for _ in range(100):
                try:
                    with urllib.request.urlopen(url + path, timeout=5) as response:
                        assert response.status == 200 and json.loads(response.read())
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise AssertionError(f"{url}{path} did not answer")
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize("dev", [False, True])
def test_the_trainer_service_without_a_token_on_all_interfaces_does_not_start(tmp_path, dev):
    message = refused(trainer_argv(tmp_path, "--host", "0.0.0.0", *(["--dev-no-token"] if dev else [])))
    expected = (
        "--dev-no-token is allowed only on a loopback host" if dev else "TRAINER_SERVICE_TOKEN is not set"
    )
    assert f"the trainer service: {expected}" in message, message


def test_the_trainer_service_without_a_token_and_no_dev_flag_does_not_start_on_loopback_either(tmp_path):
    assert "--dev-no-token" in refused(trainer_argv(tmp_path, "--host", "127.0.0.1"))


def test_a_developers_trainer_service_starts_on_loopback(tmp_path):
    started(trainer_argv(tmp_path, "--host", "127.0.0.1", "--dev-no-token"), "trainer service on ")


@pytest.mark.parametrize("dev", [False, True])
def test_the_standalone_server_without_a_token_on_all_interfaces_does_not_start(
    tiny_model_dir, tmp_path, dev
):
    argv = standalone_argv(
        tiny_model_dir, tmp_path, "--host", "0.0.0.0", *(["--dev-no-token"] if dev else [])
    )
    message = refused(argv)
    expected = (
        "--dev-no-token is allowed only on a loopback host" if dev else "INFERENCE_SERVER_TOKEN is not set"
    )
    assert f"the inference server: {expected}" in message, message


def test_a_developers_standalone_server_starts_on_loopback(tiny_model_dir, tmp_path):
    argv = standalone_argv(tiny_model_dir, tmp_path, "--host", "127.0.0.1", "--dev-no-token")
    started(argv, "inference server on ")
