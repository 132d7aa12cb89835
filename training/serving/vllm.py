"""The GPU path: vLLM's own OpenAI-compatible server with LoRA enabled, adapters hot-swapped through
its runtime LoRA API (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, which need
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). `manage.py serve_inference --engine vllm` starts it with
`start_vllm`, waits for `/health`, then `supervise`s it: heartbeats while the child lives and is
healthy, and stops it on SIGTERM/SIGINT. The gateway loads and unloads adapters
(projects.gateway.vllm); a request for a checkpoint uses the adapter's `lora_name` as its `model`.

NOT RUN against a real vLLM on the CPU machines this project is developed on (vLLM's wheel is
CUDA-only). The launcher and the gateway's calls are tested against a protocol double
(tests/projects/gateway/fake_vllm.py, started through `executable`), which checks the command line parses
and speaks vLLM's endpoints as documented; the real path is the `gpu`-marked test.

vLLM does the batching (continuous), logprobs with real top-k alternatives, `return_token_ids`,
and Hermes tool-call parsing (`--tool-call-parser hermes`).

Trust: vLLM's `--api-key` guards only `/v1/*`; it also serves `/invocations`, `/tokenize`,
`/metrics`, `/pooling`, `/score`, ... without it. So vLLM runs with our middleware
(training.serving.vllm_guard, `--middleware`), which refuses every path but `GET /health` without
the token, and `start_vllm`'s caller checks the host (training.serving.binding).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.engines.vllm_engine import LOGPROBS_MODE

GUARD_MIDDLEWARE = "training.serving.vllm_guard.BearerTokenGuard"
# The folder that holds the `training` package: on vLLM's PYTHONPATH, so the guard imports even
# from a virtualenv of vLLM's own (the guard needs only the standard library).
PROJECT_ROOT = Path(__file__).resolve().parents[2]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMServeOptions:
    model_dir: Path  # the base model's local HF directory (training.base_models.base_model_dir)
    served_model_name: str  # the base model's catalogue name
    host: str = "127.0.0.1"
    port: int = 8100
    max_loras: int = 8  # adapters resident on the GPU at once (the LRU capacity)
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    api_key: str = ""  # the server token the gateway sends
    gpu_memory_utilization: float = 0.85
    dtype: str = "auto"


def vllm_executable() -> list[str]:
    """How to run vLLM's CLI here: the `vllm` script, else the module with this Python."""
    found = shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def vllm_serve_command(
    options: VLLMServeOptions, executable: list[str] | None = None, *, python_path: str = ""
) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line and the environment variables it needs on top of the caller's
    own environment. `executable` replaces the program (default `vllm_executable()`), e.g. with a
    protocol double in tests; `python_path` is the caller's PYTHONPATH, kept after the project's."""
    command = list(executable) if executable else vllm_executable()
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
        # Logprobs under the trainer's convention (training.engines.base: after temperature), as
        # the in-process engine's: a run's rollouts sampled here train on them.
        "--logprobs-mode", LOGPROBS_MODE,
        # Every route but GET /health needs the token (the module doc); it reads VLLM_API_KEY.
        "--middleware", GUARD_MIDDLEWARE,
    ]  # fmt: skip
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "PYTHONPATH": os.pathsep.join(part for part in (str(PROJECT_ROOT), python_path) if part),
    }
    if options.api_key:
        # In the environment, not on the command line: any local process reads /proc/<pid>/cmdline,
        # and the command line is logged. vLLM takes VLLM_API_KEY when --api-key is absent.
        env["VLLM_API_KEY"] = options.api_key
    return command, env


@dataclass(frozen=True)
class HttpCall:
    method: str
    path: str
    json: dict[str, Any]


def load_adapter_call(name: str, path: str | Path) -> HttpCall:
    """Load the checkpoint at `path` into a running vLLM server as model `name`."""
    return HttpCall("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload_adapter_call(name: str) -> HttpCall:
    return HttpCall("POST", "/v1/unload_lora_adapter", {"lora_name": name})


class VLLMStartError(RuntimeError):
    """vLLM could not be started, or exited, or never became healthy."""


def start_vllm(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start vLLM with the environment `env` (complete: the caller's own plus what
    `vllm_serve_command` adds) as a child in our process group (a terminal's Ctrl-C reaches both)
    that also gets SIGTERM if we die without stopping it (Linux), so no orphan holds the GPU."""
    try:
        return subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)
    except FileNotFoundError as exc:
        raise VLLMStartError(f"cannot run {command[0]!r}: {exc.strerror}") from exc


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether vLLM's `/health` (no auth) answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def wait_until_healthy(
    process: subprocess.Popen, url: str, *, timeout_s: float, stop: threading.Event | None = None
) -> None:
    """Return once `url` is healthy; VLLMStartError if the child exits first or time runs out
    (loading a large model takes minutes: the timeout is generous by default)."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        code = process.poll()
        if code is not None:
            raise VLLMStartError(f"vLLM exited with status {code} before it was ready (its output is above)")
        if stop is not None and stop.is_set():
            raise VLLMStartError("stopped before vLLM was ready")
        if time.monotonic() > deadline:
            raise VLLMStartError(f"vLLM did not answer {url}/health within {timeout_s:g} s")
        time.sleep(0.25)


def supervise(
    process: subprocess.Popen,
    *,
    url: str,
    heartbeat: Callable[[bool], None],
    interval_s: float,
    stop: threading.Event,
) -> int | None:
    """Heartbeat every `interval_s` while the child lives and `/health` answers, until `stop` is
    set (then the child is stopped) or the child exits. `heartbeat(first)` is told whether it is
    the first beat (registration). Returns the child's exit status if it exited on its own, else
    None. A failed health check skips the beat, so routing stops when the heartbeat goes stale."""
    first = True
    while not stop.is_set():
        if process.poll() is not None:
            return process.returncode
        if healthy(url):
            try:
                heartbeat(first)
                first = False
            except Exception:  # a database hiccup must not stop serving; the next beat retries
                log.exception("heartbeat failed")
        else:
            log.warning("vLLM at %s is not healthy; skipping the heartbeat", url)
        stop.wait(interval_s)
    stop_child(process)
    return None


def stop_child(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (vLLM shuts down cleanly on it), then SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
