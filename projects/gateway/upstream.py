"""The inference servers behind the gateway: one class per dialect, one interface.

- ``send(route)`` forwards the completion to the server and returns once the reply's status and
  headers are in. It raises UpstreamUnavailable when nothing reached the server (the caller
  tries the next one), UpstreamBroken when the server stopped answering, and GatewayError when
  the request cannot be completed there.
- ``relay(reply, route, on_usage)`` passes a streamed reply to the client as it arrives, in the
  client's dialect, and reports the usage it saw once the stream ends (or the client leaves).
- ``answer(reply, route)`` reads a whole reply and returns the client's response and its usage.

``InferenceServerUpstream`` is serve_inference's own server (training.serving), which speaks the
gateway's protocol; ``VLLMUpstream`` (projects.gateway.vllm) is vLLM's server. A dialect differs
only in what it sends (``send``), how a stream's events are rewritten (``stream_filter``) and how
a whole reply is (``rewrite``): the relay and the read around them are written once, here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol
from urllib.parse import quote

from django.conf import settings
from django.http import HttpResponse

from projects.gateway.errors import GatewayError
from projects.gateway.http import UpstreamBroken, UpstreamResponse, pool
from projects.gateway.routing import Route
from projects.models import InferenceServer
from training.serving.protocol import (
    ADAPTER_HEADER,
    ADAPTER_KEY_HEADER,
    ADAPTER_SHA256_HEADER,
    MODEL_HEADER,
    USAGE_COMMENT_PREFIX,
    USAGE_HEADER,
    parse_usage,
)

Usage = tuple[int, int]  # (prompt_tokens, completion_tokens)


class StreamFilter(Protocol):
    """Rewrites a stream's bytes as they pass and keeps the usage it finds in them."""

    usage: Usage | None

    def feed(self, data: bytes) -> bytes: ...


class Upstream:
    """One inference server, spoken to in its engine's dialect (see the module doc)."""

    def __init__(self, server: InferenceServer) -> None:
        self.server = server

    async def send(self, route: Route) -> UpstreamResponse:
        raise NotImplementedError

    def stream_content_type(self, reply: UpstreamResponse) -> str:
        raise NotImplementedError

    def stream_filter(self, route: Route) -> StreamFilter:
        raise NotImplementedError

    def rewrite(
        self, reply: UpstreamResponse, body: bytes, route: Route
    ) -> tuple[HttpResponse, Usage | None]:
        """A whole reply's ``body`` as the client's response, and its usage; GatewayError when
        the body cannot be read."""
        raise NotImplementedError

    async def relay(
        self, reply: UpstreamResponse, route: Route, on_usage: Callable[[Usage], None]
    ) -> AsyncIterator[bytes]:
        events = self.stream_filter(route)
        try:
            async for chunk in reply.chunks():
                passed = events.feed(chunk)
                if passed:
                    yield passed
        except UpstreamBroken:
            return  # the client sees the stream end without [DONE]
        finally:
            reply.release()  # closes the connection if the client left before the end
            if events.usage is not None:
                on_usage(events.usage)

    async def answer(self, reply: UpstreamResponse, route: Route) -> tuple[HttpResponse, Usage | None]:
        try:
            body = await reply.read()
        except UpstreamBroken as exc:
            raise GatewayError(
                502, f"The inference server failed mid-response: {exc}", code="upstream_error"
            ) from exc
        return self.rewrite(reply, body, route)


class InferenceServerUpstream(Upstream):
    """serve_inference's own server: the client's body goes through as it was sent, the checkpoint
    in headers; usage comes back in USAGE_HEADER, or in a stream's usage comment, which the
    gateway keeps to itself."""

    async def send(self, route: Route) -> UpstreamResponse:
        headers = {
            "Authorization": f"Bearer {settings.INFERENCE_SERVER_TOKEN}",
            "Content-Type": "application/json",
            MODEL_HEADER: quote(route.target.model_id, safe="/:@"),  # a header holds latin-1 at most
        }
        if route.target.adapter_path:
            headers[ADAPTER_HEADER] = route.target.adapter_path
        checkpoint = route.target.checkpoint
        if checkpoint is not None and checkpoint.storage_key:  # fetched by key on a host without the path
            headers[ADAPTER_KEY_HEADER] = checkpoint.storage_key
            headers[ADAPTER_SHA256_HEADER] = checkpoint.sha256
        return await pool().request(
            self.server.url, "/v1/chat/completions", headers=headers, body=route.chat.raw,
            timeout=settings.GATEWAY_UPSTREAM_TIMEOUT_S,
        )  # fmt: skip

    def stream_content_type(self, reply: UpstreamResponse) -> str:
        return _content_type(reply.headers)

    def stream_filter(self, route: Route) -> StreamFilter:
        return _UsageComment()

    def rewrite(
        self, reply: UpstreamResponse, body: bytes, route: Route
    ) -> tuple[HttpResponse, Usage | None]:
        usage = parse_usage(reply.headers.get(USAGE_HEADER, "")) if reply.status == 200 else None
        return HttpResponse(body, status=reply.status, content_type=_content_type(reply.headers)), usage


def _content_type(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "application/json")


class _UsageComment:
    """Our server's events as they are, less the usage comment, which is read and kept."""

    def __init__(self) -> None:
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> bytes:
        if data.startswith(USAGE_COMMENT_PREFIX):
            self.usage = parse_usage(data)
            return b""
        return data
