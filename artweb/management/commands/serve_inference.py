"""``manage.py serve_inference --base-model NAME``: the inference server of one worker host.

Django is used here only to read settings and to register the server (and heartbeat) through
projects.gateway.services; the server itself is training.serving, which knows nothing of Django.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections
from django.utils import timezone

from projects.gateway.services import inference_server_deregister, inference_server_heartbeat
from projects.models import BaseModel


class Command(BaseCommand):
    help = "Serve one base model and its LoRA checkpoints over an OpenAI-compatible API (CPU engine)."

    def add_arguments(self, parser):
        parser.add_argument("--base-model", required=True, help="a base model's catalogue name")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=settings.INFERENCE_PORT, help="0 picks a free port")
        parser.add_argument("--url", default="", help="URL the gateway dials (default: http://HOST:PORT)")
        parser.add_argument("--capacity", type=int, default=settings.INFERENCE_ADAPTER_CAPACITY)
        parser.add_argument("--max-batch-size", type=int, default=settings.INFERENCE_MAX_BATCH_SIZE)
        parser.add_argument("--batch-window-ms", type=float, default=settings.INFERENCE_BATCH_WINDOW_MS)

    def handle(self, *args, base_model: str, host: str, port: int, url: str, capacity: int,
               max_batch_size: int, batch_window_ms: float, **options):  # fmt: skip
        import torch

        from training.engines.transformers_engine import TransformersEngine
        from training.models import ModelLoadError, load_base_model
        from training.serving.app import InferenceApp, ServerConfig
        from training.serving.protocol import Limits
        from training.serving.server import advertised_url, bind, serve

        row = BaseModel.objects.filter(name=base_model).first()
        if row is None:
            raise CommandError(
                f"no base model named {base_model!r}; add it with `manage.py registerbasemodel`"
            )
        if settings.TORCH_THREADS:
            torch.set_num_threads(settings.TORCH_THREADS)
        try:
            # The CPU engine. On GPU hosts serving is vLLM's own server (training.serving.vllm),
            # which this command does not start yet.
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
        )
        app = InferenceApp(engine, config)
        sock = bind(host, port)
        public_url = url or advertised_url(host, sock.getsockname()[1])
        started_at = timezone.now()

        def heartbeat(url: str, app: InferenceApp) -> None:
            close_old_connections()  # a connection the database dropped is reopened, not reused
            inference_server_heartbeat(
                url=url, base_model_name=row.name, engine="transformers", capacity=capacity,
                max_batch_size=max_batch_size, loaded_adapters=app.adapters.loaded(), pid=os.getpid(),
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
        )
