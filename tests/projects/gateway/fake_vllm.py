"""A PROTOCOL DOUBLE of vLLM's OpenAI-compatible server, for tests on machines without a GPU.

It is not vLLM and samples nothing: it accepts the command line of vLLM's API server that
training.serving.vllm builds (and refuses one that lacks what the gateway relies on), and answers
the endpoints artweb uses the way vLLM's documentation and source describe them, with canned
completions:

- `GET /health` (no auth); `GET /v1/models`: the served model plus each loaded LoRA adapter
  (`parent` = the served model), as vLLM lists them;
- `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (only with
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as in vLLM): 400 "has already been loaded", 404 for a
  path without adapter files or an unknown name, and vLLM's older error body
  (`{"object": "error", "message", "type", "param", "code"}`);
- `POST /v1/chat/completions`: `model` must be the served name or a loaded adapter (else 404
  "The model `x` does not exist."); the reply is "canned reply from <model>", streamed as one
  chunk per word with vLLM's final usage chunk when `stream_options.include_usage` is set.
- `--api-key`, else the VLLM_API_KEY variable: every /v1 route needs it, as in vLLM.
- Sleep mode (`--enable-sleep-mode` with VLLM_SERVER_DEV_MODE=1, as vLLM registers them):
  `POST /sleep?level=N`, `POST /wake_up`, `GET /is_sleeping`; a completion asked of a sleeping
  server is a 500, as a real one fails without its weights.
- `--middleware` (required: the launcher must pass training.serving.vllm_guard's guard): each named
  ASGI middleware class is imported, as vLLM imports it, and every request but the hooks below
  goes through it first (its answer, e.g. a 401, is relayed), as it would in vLLM's app.

Test hooks, which vLLM does not have: `GET /fake/calls` (every /v1 call received, in order),
`GET /fake/info` (argv, pid, environment flag), `POST /fake/die` (exit with status 3, as a
crashed vLLM would); FAKE_VLLM_EXIT_AT_START=<status> exits before serving; FAKE_VLLM_STARTUP_S
delays the health check like a model load; a user message "FAKE_ERROR" gets a 400.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake-vllm")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--enable-lora", action="store_true", required=True)
    parser.add_argument("--max-loras", type=int, required=True)
    parser.add_argument("--max-lora-rank", type=int, required=True)
    parser.add_argument("--max-cpu-loras", type=int, required=True)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--tool-call-parser", default="")
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--logprobs-mode", choices=["raw_logprobs", "raw_logits", "processed_logprobs",
                                                    "processed_logits"], required=True)  # fmt: skip
    parser.add_argument("--middleware", action="append", default=[])
    options = parser.parse_args(argv)
    if "training.serving.vllm_guard.BearerTokenGuard" not in options.middleware:
        parser.error("artweb's vLLM must run with its token guard (--middleware)")
    if options.max_cpu_loras < options.max_loras:  # vLLM refuses this too
        parser.error("max_cpu_loras must be >= max_loras")
    if not (Path(options.model) / "config.json").is_file():
        parser.error(f"{options.model} is not a model directory")
    return options


class State:
    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.sleep_routes = options.enable_sleep_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        self.sleeping = False
        # As vLLM: `module.Class` imported, each added with app.add_middleware (the last outermost).
        self.middleware = [
            getattr(importlib.import_module(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1])
            for path in options.middleware
        ]
        self.runtime_lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1")
        self.loras: dict[str, str] = {}  # name -> path, load order
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()


def vllm_error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    disable_nagle_algorithm = True  # as uvicorn: else a body written after its headers waits ~40 ms
    state: State

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # ------------------------------------------------------------------ plumbing
    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw) if raw else None

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _authorized(self) -> bool:
        key = self.state.options.api_key or os.environ.get("VLLM_API_KEY", "")
        return not key or self.headers.get("Authorization") == f"Bearer {key}"

    def _through_middleware(self) -> bool:
        """Run the request's method, path and headers through the --middleware stack with an inner
        app that only notes it was reached; if it was not, relay the middleware's answer."""
        reached = False

        async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
            nonlocal reached
            reached = True

        app: Any = inner
        for middleware in self.state.middleware:
            app = middleware(app)
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        path, _, query = self.path.partition("?")
        headers = [
            (key.lower().encode("latin-1"), value.encode("latin-1")) for key, value in self.headers.items()
        ]
        scope = {"type": "http", "method": self.command, "path": path, "query_string": query.encode(),
                 "headers": headers}  # fmt: skip
        asyncio.run(app(scope, receive, send))
        if reached:
            return True
        start = next(message for message in sent if message["type"] == "http.response.start")
        body = b"".join(
            message.get("body", b"") for message in sent if message["type"] == "http.response.body"
        )
        self._send(start["status"], body)
        return False

    def _record(self, body: Any) -> None:
        with self.state.lock:
            self.state.calls.append({"method": self.command, "path": self.path, "body": body})

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:
        state = self.state
        if not self.path.startswith("/fake/") and not self._through_middleware():
            return
        if self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/fake/calls":
            with state.lock:
                self._send(200, list(state.calls))
        elif self.path == "/fake/info":
            self._send(200, {"argv": sys.argv[1:], "pid": os.getpid(), "runtime_lora": state.runtime_lora})
        elif not self._authorized():
            self._send(401, {"error": "Unauthorized"})
        elif self.path == "/is_sleeping" and state.sleep_routes:
            self._send(200, {"is_sleeping": state.sleeping})
        elif self.path == "/v1/models":
            self._record(None)
            name = state.options.served_model_name
            data = [{"id": name, "object": "model", "root": state.options.model, "parent": None}]
            with state.lock:
                data += [
                    {"id": n, "object": "model", "root": p, "parent": name} for n, p in state.loras.items()
                ]
            self._send(200, {"object": "list", "data": data})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        state = self.state
        body = self._body()
        if not self.path.startswith("/fake/") and not self._through_middleware():
            return
        if self.path == "/fake/die":
            self._send(200, {"dying": True})
            self.wfile.flush()
            os._exit(3)
        if not self._authorized():
            self._send(401, {"error": "Unauthorized"})
            return
        self._record(body)
        if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and not state.runtime_lora:
            self._send(404, {"detail": "Not Found"})  # vLLM registers these routes only when allowed
        elif self.path == "/v1/load_lora_adapter":
            self._load(body)
        elif self.path == "/v1/unload_lora_adapter":
            self._unload(body)
        elif self.path.split("?")[0] in ("/sleep", "/wake_up") and state.sleep_routes:
            with state.lock:
                state.sleeping = self.path.startswith("/sleep")
            self._send(200, b"", "text/plain")
        elif self.path == "/v1/chat/completions" and state.sleeping:
            self._send(500, vllm_error(500, "the engine is asleep", "InternalServerError"))
        elif self.path == "/v1/chat/completions":
            self._chat(body)
        else:
            self._send(404, {"detail": "Not Found"})

    def _load(self, body: dict[str, Any]) -> None:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            self._send(
                400, vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
            )
            return
        with self.state.lock:
            if name in self.state.loras:
                message = f"The lora adapter '{name}' has already been loaded."
                self._send(400, vllm_error(400, message, "InvalidUserInput"))
                return
            if not (Path(path) / "adapter_config.json").is_file():
                message = f"Loading lora {name} failed: No adapter found for {path}"
                self._send(404, vllm_error(404, message, "NotFoundError"))
                return
            self.state.loras[name] = path
        self._send(200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain")

    def _unload(self, body: dict[str, Any]) -> None:
        name = body.get("lora_name")
        with self.state.lock:
            if name not in self.state.loras:
                message = f"The lora adapter '{name}' cannot be found."
                self._send(404, vllm_error(404, message, "NotFoundError"))
                return
            del self.state.loras[name]
        self._send(200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), "text/plain")

    def _chat(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        with self.state.lock:
            known = model == self.state.options.served_model_name or model in self.state.loras
        if not known:
            self._send(404, vllm_error(404, f"The model `{model}` does not exist.", "NotFoundError"))
            return
        prompt_words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages", []))
        if any(m.get("content") == "FAKE_ERROR" for m in body.get("messages", [])):
            self._send(400, vllm_error(400, "this double refuses FAKE_ERROR", "BadRequestError"))
            return
        words = ["canned", "reply", "from", str(model)]
        usage = {"prompt_tokens": prompt_words, "completion_tokens": len(words),
                 "total_tokens": prompt_words + len(words)}  # fmt: skip
        base = {"id": "chatcmpl-fake", "created": int(time.time()), "model": model}
        if not body.get("stream"):
            message = {"role": "assistant", "content": " ".join(words)}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
            self._send(200, {**base, "object": "chat.completion", "choices": [choice], "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = {**base, "object": "chat.completion.chunk"}
        deltas = [{"role": "assistant", "content": ""}] + [
            {"content": word if i == 0 else " " + word} for i, word in enumerate(words)
        ]
        for delta in deltas:
            self._event(
                {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
            )
        self._event(
            {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
        )
        if (body.get("stream_options") or {}).get("include_usage"):
            self._event({**chunk, "choices": [], "usage": usage})
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _event(self, data: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(data).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main() -> None:
    options = parse(sys.argv[1:])
    if os.environ.get("FAKE_VLLM_EXIT_AT_START"):
        print("fake vLLM: failing at start as asked", file=sys.stderr, flush=True)
        sys.exit(int(os.environ["FAKE_VLLM_EXIT_AT_START"]))
    time.sleep(float(os.environ.get("FAKE_VLLM_STARTUP_S", "0.3")))  # "loading the model"
    Handler.state = State(options)
    server = ThreadingHTTPServer((options.host, options.port), Handler)
    server.daemon_threads = True
    print(f"fake vLLM serving {options.served_model_name} on {options.host}:{options.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
