"""``manage.py up``: the whole platform on one machine — worker, web server, inference server and a
demo run."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from artweb.demo.setup import demo_start
from artweb.management.commands.demo import print_credentials, watch_run
from artweb.stack import Stack, inference_command, trainer_command, web_command, worker_command
from projects import services
from training.base_models import BUNDLED_MODEL


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
    help = "Run the platform (Celery worker + web server on 127.0.0.1:8000) and a demo run. Ctrl-C stops it."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--demo-steps", type=int, default=20, help="0 to skip the demo run")
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
               no_inference: bool, trainer_port: int = 0, **options):  # fmt: skip
        call_command("migrate", interactive=False, verbosity=0)
        if not port_free(host, port):
            raise CommandError(
                f"port {port} on {host} is in use: choose another with `make up PORT=…` (--port)"
            )
        if not no_inference and inference_port and not port_free("127.0.0.1", inference_port):
            self.stdout.write(
                f"Port {inference_port} (the inference server's) is in use: it takes a free port instead."
            )
            inference_port = 0
        if trainer_port and not port_free("127.0.0.1", trainer_port):
            trainer_port = free_port()
            self.stdout.write(f"The trainer service's port is in use: it takes {trainer_port} instead.")
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
        try:
            if trainer_port:
                stack.start("trainer", trainer_command(port=trainer_port))
            stack.start("worker", worker_command())
            stack.start("web", web_command(host=host, port=port))
            if not no_inference:
                # Named as the demo names it, so the demo's checkpoints are served by this server.
                name = "smollm2-135m-instruct" if base_model == BUNDLED_MODEL else "demo-local-model"
                services.base_model_register(name=name, source=base_model)
                stack.start("inference", inference_command(base_model=name, port=inference_port))
            self.stdout.write(f"artweb is up: http://{host}:{port}/api/v1/docs/  (logs in {stack.log_dir})")
            self.stdout.write(f"OpenAI-compatible API (team API keys): http://{host}:{port}/v1")
            self.stdout.write(
                f"Dashboard: http://{host}:{port}/  (sign in as 'demo'; forgot the password? "
                "manage.py changepassword demo)"
            )
            if demo_steps > 0:
                setup = demo_start(steps=demo_steps, base_model_source=base_model)
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
            stack.stop()
            self.stdout.write("Stopped.")
