"""The GPU path: vLLM's own OpenAI-compatible server with LoRA enabled, adapters hot-swapped through
its runtime LoRA API. NOT RUN on the CPU machines this project is developed on (vLLM's wheel is
CUDA-only): what is tested is what these functions build, against vLLM's documented flags and
endpoints (`vllm serve`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, which need
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

vLLM does the batching (continuous), logprobs with real top-k alternatives, `return_token_ids`,
and Hermes tool-call parsing (`--tool-call-parser hermes`). A request for a checkpoint uses the
adapter's `lora_name` as its `model`.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.serving.adapters import adapter_name


@dataclass(frozen=True)
class VLLMServeOptions:
    model_dir: Path  # the base model's local HF directory (training.models.base_model_dir)
    served_model_name: str  # the base model's catalogue name
    host: str = "127.0.0.1"
    port: int = 8100
    max_loras: int = 8  # adapters resident on the GPU at once (the LRU capacity)
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    api_key: str = ""  # the server token the gateway sends
    gpu_memory_utilization: float = 0.85
    dtype: str = "auto"


def vllm_serve_command(options: VLLMServeOptions) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and the environment variables it needs."""
    executable = shutil.which("vllm")
    command = [executable] if executable else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    command += [
        "serve", str(options.model_dir),
        "--served-model-name", options.served_model_name,
        "--host", options.host, "--port", str(options.port),
        "--dtype", options.dtype,
        "--gpu-memory-utilization", str(options.gpu_memory_utilization),
        "--enable-lora",
        "--max-loras", str(options.max_loras),
        "--max-lora-rank", str(options.max_lora_rank),
        "--max-cpu-loras", str(options.max_cpu_loras),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    if options.api_key:
        command += ["--api-key", options.api_key]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    return command, env


@dataclass(frozen=True)
class HttpCall:
    method: str
    path: str
    json: dict[str, Any]


def load_adapter_call(path: Path) -> HttpCall:
    """Load the checkpoint at `path` into a running vLLM server (named as on the CPU server)."""
    return HttpCall(
        "POST", "/v1/load_lora_adapter", {"lora_name": adapter_name(path), "lora_path": str(path)}
    )


def unload_adapter_call(path: Path) -> HttpCall:
    return HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": adapter_name(path)})
