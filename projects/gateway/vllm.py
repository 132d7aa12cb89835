"""Checkpoints on vLLM inference servers (``serve_inference --engine vllm``): the gateway loads each
checkpoint's LoRA adapter into vLLM on first use and speaks vLLM's dialect of the API.

- Names: a checkpoint's adapter is ``model-<trainable model id>-step-<step>`` on every server.
  The request's ``model`` is rewritten to it; the response's ``model`` back to the public id.
- Which adapters a server holds is recorded in ``InferenceServer.loaded_adapters``, least
  recently used first (``services.inference_server_adapter_use``, under a row lock); beyond the
  server's capacity the least recently used is unloaded before the new one is loaded.
- vLLM is the truth, the record only a plan: a load answered "already loaded" counts as loaded,
  and a completion answered "model does not exist" (a concurrent request's load still running,
  another gateway's eviction, a restarted vLLM) loads the adapter again and is retried once.
- Usage: vLLM puts it in the body; in streams the gateway asks for the final usage chunk and
  hides it (and the ``usage`` fields) unless the client asked for it too.
- Errors: vLLM's error bodies (``{"object": "error", ...}`` in older versions, OpenAI's shape in
  newer ones) become OpenAI error objects; a failed load is a 500 ``adapter_load_failed``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from projects.gateway.db import in_db_thread
from projects.gateway.services import inference_server_adapter_forget, inference_server_adapter_use
from projects.gateway.upstream import UpstreamResponse, pool
from projects.models import Checkpoint, InferenceServer
from training.serving.protocol import error_body
from training.serving.vllm import HttpCall, load_adapter_call, unload_adapter_call

log = logging.getLogger(__name__)


class VLLMError(Exception):
    """A request the gateway cannot complete on a vLLM server; becomes an OpenAI error object."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def adapter_name(checkpoint: Checkpoint) -> str:
    return f"model-{checkpoint.model_id}-step-{checkpoint.step}"


@dataclass
class Prepared:
    """A completion request rewritten for a vLLM server."""

    body: bytes
    public_model: str  # echoed in responses
    adapter: str | None
    stream: bool
    client_wants_usage: bool


def prepare(
    raw_body: bytes, *, public_model: str, served_model: str, checkpoint: Checkpoint | None
) -> Prepared:
    body: dict[str, Any] = json.loads(raw_body)  # the gateway has validated it
    adapter = adapter_name(checkpoint) if checkpoint is not None else None
    body["model"] = adapter or served_model
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    wants_usage = bool(options.get("include_usage"))
    if stream:
        body["stream_options"] = {**options, "include_usage": True}  # for metering
    return Prepared(json.dumps(body).encode(), public_model, adapter, stream, wants_usage)


async def complete(
    server: InferenceServer, prepared: Prepared, checkpoint: Checkpoint | None
) -> UpstreamResponse:
    """Send the completion to ``server``, loading the checkpoint's adapter first if needed.
    Raises VLLMError, or UpstreamUnavailable when the server cannot be reached (try another)."""
    if prepared.adapter is not None and checkpoint is not None:
        await _ensure_loaded(server, prepared.adapter, checkpoint.path, prepared.public_model)
    response = await _post(server, "/v1/chat/completions", prepared.body)
    if prepared.adapter is None or checkpoint is None or response.status != 404:
        return response
    body = await response.read()
    if "does not exist" not in _error_message(body):
        raise VLLMError(404, _error_message(body), code="model_not_found")
    # Not loaded after all (see the module doc): load it and try once more.
    await in_db_thread(inference_server_adapter_forget)(server_id=server.pk, names=[prepared.adapter])
    await _ensure_loaded(server, prepared.adapter, checkpoint.path, prepared.public_model)
    return await _post(server, "/v1/chat/completions", prepared.body)


async def _ensure_loaded(server: InferenceServer, name: str, path: str, public_model: str) -> None:
    # Always through the row lock, even when this adapter was the last one used: the row at hand
    # may be a remembered route's (projects.gateway.lookups), and a shortcut on its stale list
    # would leave the shared least-recently-used order wrong.
    use = await in_db_thread(inference_server_adapter_use)(server_id=server.pk, name=name)
    for old in use.evict:
        await _unload(server, old)
    if use.load:
        try:
            await _load(server, name, path, public_model)
        except Exception:
            await in_db_thread(inference_server_adapter_forget)(server_id=server.pk, names=[name])
            raise


async def _load(server: InferenceServer, name: str, path: str, public_model: str) -> None:
    response = await _call(server, load_adapter_call(name, path))
    body = await response.read()
    if response.status == 200:
        return
    message = _error_message(body)
    if "already" in message and "loaded" in message:
        return  # another request or gateway loaded it first: fine
    raise VLLMError(
        500, f"The inference server could not load the checkpoint `{public_model}`: {message}",
        code="adapter_load_failed",
    )  # fmt: skip


async def _unload(server: InferenceServer, name: str) -> None:
    """Best effort: an adapter vLLM does not know ("cannot be found") is as good as unloaded."""
    try:
        response = await _call(server, unload_adapter_call(name))
        body = await response.read()
        if response.status not in (200, 404):
            log.warning("vLLM at %s did not unload %s: %s", server.url, name, _error_message(body))
    except Exception:
        log.exception("unloading %s from %s failed", name, server.url)


async def _call(server: InferenceServer, call: HttpCall) -> UpstreamResponse:
    return await _post(server, call.path, json.dumps(call.json).encode())


async def _post(server: InferenceServer, path: str, body: bytes) -> UpstreamResponse:
    headers = {
        "Authorization": f"Bearer {settings.INFERENCE_SERVER_TOKEN}",
        "Content-Type": "application/json",
    }
    return await pool().request(
        server.url, path, headers=headers, body=body, timeout=settings.GATEWAY_UPSTREAM_TIMEOUT_S
    )


def _error_message(body: bytes) -> str:
    try:
        decoded = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return body.decode(errors="replace").strip()[:500] or "no details"
    if isinstance(decoded, dict):
        inner = decoded["error"] if isinstance(decoded.get("error"), dict) else decoded
        if isinstance(inner.get("message"), str):
            return str(inner["message"])
    return json.dumps(decoded)[:500]


def openai_error(status: int, body: bytes) -> dict[str, Any]:
    """OpenAI's error object for an error response from vLLM."""
    try:
        decoded = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        decoded = None
    # vLLM's codes are HTTP statuses (ints); OpenAI's are names.
    code = "model_not_found" if status == 404 else "upstream_error"
    if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):  # newer vLLM: OpenAI's shape
        error = decoded["error"]
        named = error.get("code") if isinstance(error.get("code"), str) else code
        return error_body(status, str(error.get("message", "")), code=named, param=error.get("param"))
    param = decoded.get("param") if isinstance(decoded, dict) else None
    return error_body(status, _error_message(body), code=code, param=param)


def rewrite_completion(body: bytes, public_model: str) -> tuple[bytes, tuple[int, int] | None]:
    """A non-streamed completion with the public model id, and its (prompt, completion) usage."""
    decoded = json.loads(body)
    decoded["model"] = public_model
    return json.dumps(decoded).encode(), _usage(decoded.get("usage"))


class StreamRewriter:
    """Rewrites vLLM's server-sent events as they pass (whole events only; partial ones wait for
    the rest): the public model id, and usage hidden unless the client asked for it."""

    def __init__(self, public_model: str, client_wants_usage: bool) -> None:
        self.public_model = public_model
        self.client_wants_usage = client_wants_usage
        self.usage: tuple[int, int] | None = None
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        return b"".join(self._event(event) for event in events)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event + b"\n\n"  # [DONE], comments
        chunk = json.loads(event[6:])
        if "model" in chunk:  # not in a late error event
            chunk["model"] = self.public_model
        usage = _usage(chunk.get("usage"))
        if usage is not None:
            self.usage = usage
        if not self.client_wants_usage:
            if usage is not None and not chunk.get("choices"):
                return b""  # the usage chunk the gateway asked for
            chunk.pop("usage", None)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _usage(usage: Any) -> tuple[int, int] | None:
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage["prompt_tokens"], int(usage.get("completion_tokens") or 0)
    return None
