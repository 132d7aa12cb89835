"""Checkpoints on vLLM inference servers (``serve_inference --engine vllm``): the gateway loads each
checkpoint's LoRA adapter into vLLM on first use and speaks vLLM's dialect of the API
(``VLLMUpstream``, one of the two upstreams of projects.gateway.upstream).

- Names: a checkpoint's adapter is ``model-<trainable model id>-step-<step>-<secret suffix>`` on
  every server, the suffix an HMAC of the checkpoint under INFERENCE_ADAPTER_NAME_KEY
  (projects.serving_names): whoever reaches a server cannot name another team's adapter from its id
  and step. The request's ``model`` is rewritten to it; the response's ``model`` back to the public
  id.
- Where vLLM loads an adapter from: the folder the server's checkpoint fetcher (``fetch_url``,
  training.serving.fetch_server) answers after fetching it by store key into its host's cache, so a
  vLLM host needs no shared volume; the writer's folder only for a server without a fetcher.
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
from typing import Any

from django.conf import settings
from django.http import HttpResponse, JsonResponse

from projects.gateway.db import in_db_thread
from projects.gateway.errors import GatewayError
from projects.gateway.http import UpstreamResponse, pool
from projects.gateway.routing import Route
from projects.gateway.services import inference_server_adapter_forget, inference_server_adapter_use
from projects.gateway.upstream import StreamFilter, Upstream, Usage
from projects.models import Checkpoint, InferenceServer
from projects.serving_names import secret_suffix
from training.serving.protocol import FETCH_PATH
from training.serving.vllm import HttpCall, load_adapter_call, unload_adapter_call
from training.wire.openai_errors import error_message, error_object

log = logging.getLogger(__name__)


def adapter_name(checkpoint: Checkpoint) -> str:
    identity = f"model-{checkpoint.model_id}-step-{checkpoint.step}"
    return f"{identity}-{secret_suffix(identity)}"


class VLLMUpstream(Upstream):
    """A vLLM server: the body's ``model`` names the adapter (loaded first if needed), replies and
    stream events are rewritten to the public model id (see the module doc)."""

    async def send(self, route: Route) -> UpstreamResponse:
        """Raises GatewayError, or UpstreamUnavailable when the server cannot be reached."""
        target, server = route.target, self.server
        # A checkpoint without files (a client model's step 0) is the base model (routing).
        adapter = (
            adapter_name(target.checkpoint) if target.checkpoint is not None and target.adapter_path else None
        )
        body = request_body(route.chat.decoded, model=adapter or target.base_model.name)
        if adapter is None or target.checkpoint is None:
            return await _post(server, "/v1/chat/completions", body)
        path, public_model = await _adapter_folder(server, target.checkpoint), target.model_id
        await _ensure_loaded(server, adapter, path, public_model)
        response = await _post(server, "/v1/chat/completions", body)
        if response.status != 404:
            return response
        answered = await response.read()
        if "does not exist" not in _error_message(answered):
            raise GatewayError(404, _error_message(answered), code="model_not_found")
        # Not loaded after all (see the module doc): load it and try once more.
        await in_db_thread(inference_server_adapter_forget)(server_id=server.pk, names=[adapter])
        await _ensure_loaded(server, adapter, path, public_model)
        return await _post(server, "/v1/chat/completions", body)

    def stream_content_type(self, reply: UpstreamResponse) -> str:
        return "text/event-stream; charset=utf-8"

    def stream_filter(self, route: Route) -> StreamFilter:
        return StreamRewriter(route.target.model_id, route.chat.request.include_usage)

    def rewrite(
        self, reply: UpstreamResponse, body: bytes, route: Route
    ) -> tuple[HttpResponse, Usage | None]:
        if reply.status != 200:
            return JsonResponse(openai_error(reply.status, body), status=reply.status), None
        try:
            rewritten, usage = rewrite_completion(body, route.target.model_id)
        except (ValueError, TypeError) as exc:
            raise GatewayError(502, f"The inference server sent an unreadable reply: {exc}",
                               code="upstream_error") from exc  # fmt: skip
        return HttpResponse(rewritten, status=200, content_type="application/json"), usage


def request_body(decoded: dict[str, Any], *, model: str) -> bytes:
    """The client's (validated) body for vLLM: ``model`` as vLLM knows it, and a stream asks for
    the final usage chunk, for metering (StreamRewriter hides it unless the client asked too)."""
    body = {**decoded, "model": model}
    if body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return json.dumps(body).encode()


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
    raise GatewayError(
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


async def _adapter_folder(server: InferenceServer, checkpoint: Checkpoint) -> str:
    """The folder vLLM loads the checkpoint from, on its own host: fetched there by store key and
    digest through the server's checkpoint fetcher (training.serving.fetch_server); the writer's
    own folder only for a server without one, or a row recorded before storage keys."""
    if not (server.fetch_url and checkpoint.storage_key):
        return checkpoint.path
    body = json.dumps({"key": checkpoint.storage_key, "sha256": checkpoint.sha256}).encode()
    headers = {
        "Authorization": f"Bearer {settings.INFERENCE_SERVER_TOKEN}",
        "Content-Type": "application/json",
    }
    response = await pool().request(
        server.fetch_url, FETCH_PATH, headers=headers, body=body, timeout=settings.GATEWAY_UPSTREAM_TIMEOUT_S
    )
    answered = await response.read()
    if response.status == 200:
        try:
            return str(json.loads(answered)["path"])
        except (ValueError, KeyError, TypeError):
            raise GatewayError(502, "The checkpoint fetcher answered without a path.",
                               code="adapter_fetch_failed") from None  # fmt: skip
    status = 404 if response.status == 404 else 502
    raise GatewayError(status, f"The inference server's host could not fetch the checkpoint: "
                       f"{_error_message(answered)}", code="model_not_found" if status == 404 else "adapter_fetch_failed")  # fmt: skip


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
    """The body's error message (training.wire.openai_errors.error_message), else what it says."""
    message = error_message(body)
    if message:
        return message
    try:
        return json.dumps(json.loads(body))[:500]
    except (UnicodeDecodeError, json.JSONDecodeError):
        return body.decode(errors="replace").strip()[:500] or "no details"


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
        return error_object(status, str(error.get("message", "")), code=named, param=error.get("param"))
    param = decoded.get("param") if isinstance(decoded, dict) else None
    return error_object(status, _error_message(body), code=code, param=param)


def rewrite_completion(body: bytes, public_model: str) -> tuple[bytes, Usage | None]:
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
        self.usage: Usage | None = None
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


def _usage(usage: Any) -> Usage | None:
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage["prompt_tokens"], int(usage.get("completion_tokens") or 0)
    return None
