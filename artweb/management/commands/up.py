"""``manage.py up``: the whole platform on one machine — worker, web server, inference server and a
demo run."""

from __future__ import annotations

import contextlib
import errno
import http.client
import os
import secrets
import signal
import socket
import time
import urllib.request

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from artweb.demo import STEPS as DEMO_STEPS
from artweb.demo.setup import DEMO_TEAM, demo_start
from artweb.management.commands.demo import print_credentials, watch_run
from artweb.stack import Stack, inference_command, listen, trainer_command, web_command, worker_command
from projects import services
from projects.errors import DomainError
from projects.models import Run, RunStatus
from training.model_files import BUNDLED_MODEL


def listen_or_another(host: str, port: int, *, what: str, stdout) -> socket.socket:
    """A listening socket on ``port`` (``stack.listen``), or, if it is taken, on a free port, with
    one line naming both; ``port`` 0 takes a free one quietly. Bound here and handed to the server
    (``--fd``): nothing can take the port between this line and the server's first request."""
    try:
        return listen(host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
    sock = listen(host, 0)
    stdout.write(f"Port {port} ({what}) is in use: it takes {sock.getsockname()[1]} instead.")
    return sock


def wait_for_web(url: str, *, stack: Stack, timeout_s: float = 300.0) -> None:
    """Return once ``url`` (the web server's /healthz) answers 200; a web server (or any child) that
    exits meanwhile raises RuntimeError (Stack.check_alive), a silent one CommandError."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(
                url, timeout=max(0.5, min(5.0, deadline - time.monotonic()))
            ) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass  # not serving yet: the listening socket queues the connection, or resets it
        stack.check_alive()
        if time.monotonic() > deadline:
            raise CommandError(f"the web server did not answer {url} within {timeout_s:.0f}s")
        time.sleep(0.25)


def earlier_demo_run() -> Run | None:
    """The demo run of an earlier start (the newest that was not cancelled), if any: ``up`` starts
    the demo on the first start only, or when asked (``--demo``, ``make up DEMO=1``)."""
    return (
        Run.objects.filter(model__project__team__name=DEMO_TEAM, model__project__name="demo")
        .exclude(status=RunStatus.CANCELLED)
        .order_by("-id")
        .first()
    )


def cancel_if_queued(run: Run) -> bool:
    """Cancel ``run`` if no worker took it yet: a start that failed or was stopped must not leave
    its demo queued to train ahead of the next start's work. True if it was cancelled."""
    run.refresh_from_db()
    if run.status != RunStatus.QUEUED:
        return False
    with contextlib.suppress(DomainError):  # a worker took it meanwhile
        services.run_cancel(run=run)
    run.refresh_from_db()
    return run.status == RunStatus.CANCELLED


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def own_gateway_allowed(host: str, port: int) -> str:
    """OUTBOUND_ALLOW for the web and worker processes: the operator's entries plus this platform's
    own gateway (a team may point a judge or a reference at ``http://127.0.0.1:<port>/v1``; the
    gateway wants a team API key like any caller). Nothing else on this machine becomes reachable."""
    own = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    if host in ("0.0.0.0", "::", "127.0.0.1", "localhost"):
        own = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"]
    entries = [entry for entry in os.environ.get("OUTBOUND_ALLOW", "").split(",") if entry.strip()]
    return ",".join(entries + [entry for entry in own if entry not in entries])


def torch_process_environment(torch_processes: int, cores: int | None = None) -> dict[str, str]:
    """The thread settings for the torch processes ``up`` starts on this host (the worker and the
    inference server): ``TORCH_THREADS`` splits the cores between them (cores // processes, at
    least 1) and ``OMP_WAIT_POLICY=PASSIVE`` makes OpenMP threads sleep rather than spin at a
    barrier. Measured (benchmarks/threads_split.py, README): two processes with torch's default
    of one thread per core each ran 8-12x slower than split; the operator's values win."""
    cores = cores or os.cpu_count() or 1
    environment = {
        "TORCH_THREADS": str(max(1, cores // max(1, torch_processes))),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    return {name: os.environ.get(name) or value for name, value in environment.items()}


class Command(BaseCommand):
    help = (
        "Run the platform (Celery worker + web server on 127.0.0.1:8000) and, on the first start, a demo "
        "run. Ctrl-C stops it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument(
            "--demo-steps", type=int, default=DEMO_STEPS, help="the demo run's steps; 0 skips it"
        )
        parser.add_argument(
            "--demo", action="store_true",
            help="start a demo run even though an earlier start ran one (`make up DEMO=1`)",
        )  # fmt: skip
        parser.add_argument("--base-model", default=BUNDLED_MODEL)
        parser.add_argument(
            "--inference-port", type=int, default=settings.INFERENCE_PORT, help="0 picks a free port"
        )
        parser.add_argument("--no-inference", action="store_true", help="do not start an inference server")
        parser.add_argument(
            "--trainer-port", type=int, default=settings.TRAINER_SERVICE_PORT,
            help="the trainer service's port (client training jobs keep their sessions there); 0: none",
        )  # fmt: skip

    def handle(self, *args, host: str, port: int, demo_steps: int, base_model: str, inference_port: int,
               no_inference: bool, trainer_port: int = 0, demo: bool = False, **options):  # fmt: skip
        call_command("migrate", interactive=False, verbosity=0)
        # Every port is bound and listening here, before anything starts, and handed to its server:
        # no other process can take one between a check and the server's own bind.
        try:
            web_socket = listen(host, port)
        except OSError as exc:
            raise CommandError(
                f"port {port} on {host} is in use: choose another with `make up PORT=…` (--port)"
            ) from exc
        sockets = [web_socket]
        inference_socket = trainer_socket = None
        if not no_inference:
            inference_socket = listen_or_another(
                "127.0.0.1", inference_port, what="the inference server's", stdout=self.stdout
            )
            sockets.append(inference_socket)
        if trainer_port:
            trainer_socket = listen_or_another(
                "127.0.0.1", trainer_port, what="the trainer service's", stdout=self.stdout
            )
            sockets.append(trainer_socket)
            trainer_port = trainer_socket.getsockname()[1]
        if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
            # This stack owns its database: a run left running was stopped with the last one.
            for run_id in services.runs_pause_interrupted():
                self.stdout.write(
                    f"Run {run_id} was running when the platform stopped: paused; resume it to continue."
                )
        # Ctrl-C and SIGTERM both stop the stack; SIGINT is re-armed because a parent (a script, a
        # non-interactive shell) may have started us with it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        os.environ["OUTBOUND_ALLOW"] = own_gateway_allowed(host, port)  # the children's environment
        os.environ.update(torch_process_environment(1 if no_inference else 2))
        if trainer_port:  # the worker trains client jobs' sessions there (its children inherit this)
            os.environ["TRAINER_SERVICE_URL"] = f"http://127.0.0.1:{trainer_port}"
            os.environ["TRAINER_SERVICE_TOKEN"] = os.environ.get(
                "TRAINER_SERVICE_TOKEN"
            ) or secrets.token_urlsafe(32)
        stack = Stack(settings.DATA_DIR / "logs")  # after the environment above: its children's copy
        demo_run = None
        try:
            if trainer_socket is not None:
                stack.start("trainer", trainer_command(port=trainer_port, fd=trainer_socket.fileno()),
                            sock=trainer_socket)  # fmt: skip
            stack.start("worker", worker_command())
            stack.start("web", web_command(fd=web_socket.fileno()), sock=web_socket)
            if inference_socket is not None:
                # Named as the demo names it, so the demo's checkpoints are served by this server.
                name = "smollm2-135m-instruct" if base_model == BUNDLED_MODEL else "demo-local-model"
                services.base_model_register(name=name, source=base_model)
                stack.start(
                    "inference",
                    inference_command(base_model=name, port=inference_socket.getsockname()[1],
                                      fd=inference_socket.fileno()),
                    sock=inference_socket,
                )  # fmt: skip
            dial = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            wait_for_web(f"http://{f'[{dial}]' if ':' in dial else dial}:{port}/healthz", stack=stack)
            self.stdout.write(f"artweb is up: http://{host}:{port}/api/v1/docs/  (logs in {stack.log_dir})")
            self.stdout.write(f"OpenAI-compatible API (team API keys): http://{host}:{port}/v1")
            self.stdout.write(
                f"Dashboard: http://{host}:{port}/  (sign in as 'demo'; forgot the password? "
                "manage.py changepassword demo)"
            )
            earlier = earlier_demo_run() if demo_steps > 0 and not demo else None
            if earlier is not None:
                self.stdout.write(
                    f"The demo ran on an earlier start (run {earlier.pk}, {earlier.status}); "
                    "`make up DEMO=1` (manage.py up --demo) starts another."
                )
            elif demo_steps > 0:
                setup = demo_start(steps=demo_steps, base_model_source=base_model)
                demo_run = setup.run
                print_credentials(self.stdout, setup)
                run = watch_run(setup.run, stack=stack, stdout=self.stdout, timeout_s=float("inf"))
                self.stdout.write(
                    f"Demo run {run.pk} {run.status}. The platform keeps running; Ctrl-C stops it."
                )
            while True:
                stack.check_alive()
                time.sleep(1)
        except KeyboardInterrupt:
            self.stdout.write("\nStopping worker, web, inference and trainer servers…")
        finally:
            for sock in sockets:  # those not handed to a server yet
                sock.close()
            stack.stop()
            if demo_run is not None and cancel_if_queued(demo_run):
                self.stdout.write(
                    f"Demo run {demo_run.pk} had not started: cancelled (the next start runs the demo again)."
                )
            self.stdout.write("Stopped.")
