"""`manage.py up` starts the worker, the web server, the inference server and the trainer service;
Ctrl-C (SIGINT) stops all of them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.integration.test_demo_command import ROOT, embedded_env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_up_serves_the_api_and_ctrl_c_stops_everything(tmp_path):
    port = free_port()
    data_dir = tmp_path / "data"
    process = subprocess.Popen(
        [sys.executable, "manage.py", "up", "--port", str(port), "--demo-steps", "0"],
        cwd=ROOT, env=embedded_env(data_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        body = b""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
                    body = response.read()
                    break
            except OSError:
                time.sleep(0.5)
        assert body == b'{"status": "ok"}', "web server did not come up"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/schema/", timeout=5) as response:
            assert b"openapi" in response.read()
        pids = {p.stem: int(p.read_text()) for p in (data_dir / "logs").glob("*.pid")}
        assert set(pids) == {"worker", "web", "inference", "trainer"}
        # What `up` sets for its children reaches them (it once did not: the stack copied the
        # environment before): the own gateway allowed outbound, and the trainer service's URL.
        environ = dict(
            item.split(b"=", 1)
            for item in Path(f"/proc/{pids['worker']}/environ").read_bytes().split(b"\0")
            if b"=" in item
        )
        assert f"127.0.0.1:{port}".encode() in environ[b"OUTBOUND_ALLOW"]
        assert (
            environ[b"TRAINER_SERVICE_URL"].startswith(b"http://127.0.0.1:")
            and environ[b"TRAINER_SERVICE_TOKEN"]
        )
        # The trainer service (client training jobs' sessions) answers on the URL it logged.
        deadline = time.monotonic() + 60
        while "trainer service on " not in (data_dir / "logs" / "trainer.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, "the trainer service did not start"
            time.sleep(0.5)
        trainer_url = (
            (data_dir / "logs" / "trainer.log").read_text().split("trainer service on ")[1].split()[0]
        )
        with urllib.request.urlopen(f"{trainer_url}/health", timeout=5) as response:
            assert response.read() == b'{"status": "ok"}'
        refused = urllib.request.Request(f"{trainer_url}/stats")
        try:
            urllib.request.urlopen(refused, timeout=5)
            raise AssertionError("the trainer service answered without its token")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        # Its token is a random one of this start, in its environment, never on its command line.
        token = environ[b"TRAINER_SERVICE_TOKEN"]
        assert len(token) >= 32 and token not in Path(f"/proc/{pids['trainer']}/cmdline").read_bytes()
        deadline = time.monotonic() + 60
        while "ready." not in (data_dir / "logs" / "worker.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, "worker did not start"
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # the test failed before Ctrl-C: stop the stack as Ctrl-C does
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
            # Whatever it could not stop must not outlive the test (a leftover inference server
            # or trainer service holds its port for every later test).
            for pid_file in (data_dir / "logs").glob("*.pid"):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    assert process.returncode == 0, output
    assert "Stopped." in output
    for name, pid in pids.items():
        assert not alive(pid), f"{name} (pid {pid}) survived Ctrl-C"
    assert not list((data_dir / "logs").glob("*.pid"))
