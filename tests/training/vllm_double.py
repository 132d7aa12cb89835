"""A double of vLLM's OpenAI server, for a run's rollouts in vLLM's dialect
(training.engines.remote_engine): the endpoints that dialect uses, shaped as vLLM documents them,
over the transformers engine of the tiny model. vLLM itself needs CUDA; this is what runs here.

- ``POST /v1/completions``: ``prompt`` as token ids (one list, or a list of lists), the sampling
  fields vLLM takes, ``logprobs`` (k alternatives; the sampled token's always), and
  ``return_tokens_as_token_ids`` (tokens spelled ``token_id:<id>``). Like vLLM, each prompt of a
  batch is its own request: one ``seed`` for several prompts seeds each the same. Stricter than
  vLLM, which ignores fields it does not know: an unknown field is a 400 (a typo in our body shows).
- ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``: vLLM's runtime LoRA API (plain-text
  success answers, ``{"object": "error", ...}`` failures, "already been loaded" / "cannot be found").
- An adapter folder is read only under ``host_root``, when given: the double's host's own disk.
- ``forget_adapters()``: a restarted vLLM (completions for a forgotten adapter are a 404, "does not exist").
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from training.engines.base import SamplingParams

COMPLETION_FIELDS = frozenset({
    "model", "prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "logprobs",
    "return_tokens_as_token_ids", "stream",
})  # fmt: skip


class VLLMDouble:
    def __init__(
        self, engine: Any, *, served_model: str, host_root: Path | None = None, token: str = ""
    ) -> None:
        self.engine = engine
        self.served_model = served_model
        self.host_root = host_root.resolve() if host_root is not None else None
        self.token = token
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body) of every request
        self.loaded: dict[str, Path] = {}
        self._lock = threading.Lock()  # the engine samples one request at a time
        self._server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                double.requests.append((self.path, body))
                if double.token and self.headers.get("authorization") != f"Bearer {double.token}":
                    return self._answer(401, {"error": {"message": "Unauthorized", "code": 401}})
                route = {"/v1/completions": double.complete, "/v1/load_lora_adapter": double.load,
                         "/v1/unload_lora_adapter": double.unload}.get(self.path)  # fmt: skip
                if route is None:
                    return self._answer(404, {"detail": "Not Found"})
                status, answer = route(body)
                self._answer(status, answer)

            def _answer(self, status: int, answer: Any) -> None:
                data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header(
                    "content-type", "text/plain" if isinstance(answer, str) else "application/json"
                )
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def forget_adapters(self) -> None:
        with self._lock:
            for name in list(self.loaded):
                self.engine.unload_adapter(name)
            self.loaded.clear()

    # ------------------------------------------------------------------ routes
    def load(self, body: dict[str, Any]) -> tuple[int, Any]:
        name, path = body.get("lora_name"), Path(str(body.get("lora_path")))
        with self._lock:
            if name in self.loaded:
                return 400, _error(f"The lora adapter '{name}' has already been loaded.")
            if self.host_root is not None and not path.resolve().is_relative_to(self.host_root):
                return 400, _error(f"Loading lora {name} failed: No adapter found for {path}")
            if not (path / "adapter_config.json").is_file():
                return 400, _error(f"Loading lora {name} failed: No adapter found for {path}")
            self.engine.load_adapter(str(name), path)
            self.loaded[str(name)] = path
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = body.get("lora_name")
        with self._lock:
            if name not in self.loaded:
                return 404, _error(f"The lora adapter '{name}' cannot be found.", code=404)
            self.engine.unload_adapter(str(name))
            del self.loaded[str(name)]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        unknown = set(body) - COMPLETION_FIELDS
        if unknown:
            return 400, _error(f"unknown fields {sorted(unknown)}")
        if body.get("n", 1) != 1 or body.get("stream") or body.get("include_stop_str_in_output"):
            return 400, _error("the double serves n=1, no stream, stop strings cut from the text")
        model = body.get("model")
        prompt = body.get("prompt")
        prompts = [prompt] if prompt and isinstance(prompt[0], int) else prompt
        if not prompts or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
        ):
            return 400, _error("prompt must be token ids")
        k = body.get("logprobs")
        sampling = SamplingParams(
            temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
            top_k=max(0, body.get("top_k") or 0), min_p=body.get("min_p") or 0.0,
            max_new_tokens=body.get("max_tokens") or 16, stop=list(body.get("stop") or []),
            seed=body.get("seed"), top_logprobs=k or 0, stop_token_ids=list(body.get("stop_token_ids") or []),
        )  # fmt: skip
        with self._lock:
            if model != self.served_model and model not in self.loaded:
                return 404, {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                       "param": None, "code": 404}}  # fmt: skip
            adapter = None if model == self.served_model else model
            # vLLM: every prompt is a request of its own, each seeded with the request's seed.
            outputs = [self.engine.generate_from_tokens([p], sampling, adapter)[0] for p in prompts]
        choices = []
        for index, choice in enumerate(outputs):
            logprobs = None
            if k is not None:
                spelled = [f"token_id:{t}" for t in choice.token_ids]
                tops = None
                if body.get("return_tokens_as_token_ids"):
                    tops = [
                        {**{f"token_id:{t}": v for t, v in (choice.top_logprobs or [[]] * len(spelled))[i]},
                         spelled[i]: choice.logprobs[i]}
                        for i in range(len(spelled))
                    ]  # fmt: skip
                else:  # vLLM spells tokens as text then: the dialect must not rely on it
                    spelled = [self.engine.tokenizer.decode([t]) for t in choice.token_ids]
                logprobs = {"text_offset": list(range(len(spelled))), "token_logprobs": choice.logprobs,
                            "tokens": spelled, "top_logprobs": tops}  # fmt: skip
            choices.append({"index": index, "text": choice.text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason, "stop_reason": None})  # fmt: skip
        completion_tokens = sum(len(c.token_ids) for c in outputs)
        prompt_tokens = sum(len(p) for p in prompts)
        return 200, {
            "id": f"cmpl-{len(self.requests)}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }  # fmt: skip


def _error(message: str, code: int = 400) -> dict[str, Any]:
    """vLLM's older error body (its LoRA routes still answer it)."""
    return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": code}
