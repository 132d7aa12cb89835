"""Start and stop the processes of one host: a Celery worker (with beat), the web server, an
inference server and the trainer service.

Used by ``manage.py up`` and ``manage.py demo``. Children run in their own process group so
Ctrl-C (or any exit) stops them and everything they spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings

from projects.queues import Queue

BASE_DIR = Path(settings.BASE_DIR)


def host_queues() -> list[str]:
    """Every queue work can be sent to on a one-host stack: housekeeping, the default work queue
    and each base model's own (projects.jobs.queues), so no run waits on a queue nobody serves."""
    from projects.models import BaseModel

    queues = {Queue.TRAIN.value, Queue.DEFAULT.value, settings.WORK_QUEUE_DEFAULT}
    queues |= set(BaseModel.objects.exclude(queue="").values_list("queue", flat=True))
    return sorted(queues)


def worker_command(*, concurrency: int = 1, beat: bool = True, loglevel: str = "INFO") -> list[str]:
    # One training process per worker: a run owns the CPU/GPU it trains on.
    command = [
        sys.executable, "-m", "celery", "-A", "artweb", "worker",
        "-Q", ",".join(host_queues()),
        "-c", str(concurrency), "--prefetch-multiplier", "1",
        "--loglevel", loglevel, "-n", f"artweb-{os.getpid()}@%h",
    ]  # fmt: skip
    if beat:
        command += ["-B", "--schedule", str(settings.CELERY_BEAT_SCHEDULE_FILENAME)]
    return command


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (0: a free port), bound here so that no other process can
    take the port between a check and a child's own bind: ``up`` hands it to the child that serves
    on it (``--fd``). OSError (EADDRINUSE) if the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly, as training.serving.server.bind: asyncio sets TCP_NODELAY only then.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only: a listener still clashes
        sock.bind((host, port))
        sock.listen(2048)  # listening now: a second bind of the port fails, even with SO_REUSEADDR
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def web_command(*, fd: int) -> list[str]:
    """The web server (uvicorn) on the listening socket ``fd`` (``listen``) that it inherits."""
    return [sys.executable, "-m", "artweb.serve_web", "--fd", str(fd), "--log-level", "warning"]


def trainer_command(*, port: int, host: str = "127.0.0.1", fd: int | None = None) -> list[str]:
    """The host's trainer service (training.hosting.service): it writes checkpoints under
    CHECKPOINT_DIR only, and reads its token from TRAINER_SERVICE_TOKEN in the environment; with
    ``fd`` it serves on that inherited listening socket (bound to ``host:port``)."""
    command = [sys.executable, "-m", "training.hosting.service", "--root", str(settings.CHECKPOINT_DIR),
               "--model-cache-dir", str(settings.MODEL_CACHE_DIR), "--spill-dir", str(settings.DATA_DIR / "trainer-spill"),
               "--host", host, "--port", str(port), "--device", settings.TRAINING_DEVICE,
               "--memory-budget-mb", str(settings.TRAINER_SESSION_MEMORY_MB)]  # fmt: skip
    return command + (["--fd", str(fd)] if fd is not None else [])


def inference_command(
    *, base_model: str, host: str = "127.0.0.1", port: int | None = None, fd: int | None = None
) -> list[str]:
    """The inference server for one base model (its catalogue name); the gateway finds it through
    the heartbeat it writes, so its port only has to be free. With ``fd`` it serves on that
    inherited listening socket (bound to ``host:port``)."""
    port = settings.INFERENCE_PORT if port is None else port
    command = [sys.executable, "manage.py", "serve_inference", "--base-model", base_model, "--host", host,
               "--port", str(port)]  # fmt: skip
    return command + (["--fd", str(fd)] if fd is not None else [])


class Stack:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}
        self.env = os.environ.copy()
        if not self.env.get("PROMETHEUS_MULTIPROC_DIR"):
            # One folder for this host's processes' samples (projects.metrics), empty at start.
            metrics_dir = Path(settings.DATA_DIR) / "prometheus"
            if metrics_dir.exists():
                for stale in metrics_dir.glob("*.db"):
                    stale.unlink()
            metrics_dir.mkdir(parents=True, exist_ok=True)
            self.env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)

    def start(self, name: str, command: list[str], *, sock: socket.socket | None = None) -> subprocess.Popen:
        """Start ``command``; ``sock`` (a ``listen`` socket named by ``--fd`` in it) is handed to the
        child and closed here, so the child alone accepts on it."""
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
        try:
            process = subprocess.Popen(
                command,
                cwd=BASE_DIR,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
                pass_fds=(sock.fileno(),) if sock is not None else (),
            )
        finally:
            if sock is not None:
                sock.close()
        self.processes[name] = process
        (self.log_dir / f"{name}.pid").write_text(str(process.pid))
        return process

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {process.returncode}; see {self.log_dir / (name + '.log')}"
                )

    def stop(self, timeout: float = 10.0) -> None:
        # Killing a worker mid-step is safe: a run resumes from its last recorded checkpoint.
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for name in self.processes:
            (self.log_dir / f"{name}.pid").unlink(missing_ok=True)
        self.processes.clear()
