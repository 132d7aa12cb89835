"""``/v1/models`` and ``/v1/chat/completions``: OpenAI's API in front of the inference servers.

Async views (Django under ASGI), so a stream is relayed chunk by chunk as the server writes it,
and many slow generations wait without holding a thread each.

Latency (the gateway should add only a few milliseconds): every step before forwarding
(authenticate the key, count the request against the rate limit, validate the body, resolve the
model within the caller's team, list live servers) runs in ONE call on a small pool of database
threads of our own. Those threads keep their database connection between requests (Django's
per-request threads under ASGI would open a new one for every request), at most DB_THREADS per
web process; a connection that failed is dropped and reopened on its next use. Usage is written
on the same pool after the response has gone out, so metering never delays a reply; a usage
record can therefore trail its response by a moment (and is lost if the process dies then).

Errors are OpenAI's error object: bad key 401, bad parameters 400, unknown (or another team's)
model 404, over the rate limit 429 and no live server 503, both with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from projects import services as project_services
from projects.errors import DomainError
from projects.gateway import lookups, routing, vllm
from projects.gateway.db import in_db_thread
from projects.gateway.ratelimit import rate_limit_hit
from projects.gateway.services import usage_record
from projects.gateway.upstream import UpstreamBroken, UpstreamResponse, UpstreamUnavailable, pool
from projects.models import ApiKey, InferenceServer, Team
from training.serving.protocol import (
    ADAPTER_HEADER,
    MODEL_HEADER,
    USAGE_COMMENT_PREFIX,
    USAGE_HEADER,
    ChatRequest,
    Limits,
    RequestError,
    error_body,
    parse_chat_request,
    parse_usage,
)

_background: set[asyncio.Task] = set()  # strong references until the usage writes finish


def _after_response(func: Callable[..., Any], *args: Any) -> None:
    task = asyncio.get_running_loop().create_task(in_db_thread(func)(*args))
    _background.add(task)
    task.add_done_callback(_background.discard)


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after  # seconds, sent as Retry-After

    def response(self) -> JsonResponse:
        response = JsonResponse(error_body(self.status, self.message, code=self.code, param=self.param),
                                status=self.status)  # fmt: skip
        if self.retry_after is not None:
            response["Retry-After"] = str(self.retry_after)
        return response


@dataclass
class Route:
    api_key: ApiKey | None  # None: a signed-in dashboard user (the playground); not metered per key
    target: routing.Target
    servers: list[InferenceServer]
    stream: bool


def _authenticate(authorization: str | None) -> ApiKey:
    raw = _bearer(authorization)
    digest = lookups.key_digest(raw)
    api_key = lookups.api_keys.get(digest)  # see lookups for the revocation lag this costs
    if api_key is None:
        api_key = project_services.api_key_authenticate(raw=raw)
        if api_key is not None:
            lookups.api_keys.put(digest, api_key, lookups.cache_seconds())
    if api_key is None:
        raise GatewayError(401, "Incorrect API key provided, or the key was revoked.", code="invalid_api_key")
    _count_request(api_key)
    return api_key


def _bearer(authorization: str | None) -> str:
    scheme, _, raw = (authorization or "").partition(" ")
    if scheme != "Bearer" or not raw.strip():
        raise GatewayError(
            401, "Missing API key: use 'Authorization: Bearer <team API key>'.", code="missing_api_key"
        )
    return raw.strip()


def _count_request(api_key: ApiKey) -> None:
    """Count the request against the key's rate limit; 429 over it."""
    retry_after = rate_limit_hit(
        api_key_id=api_key.pk, limit_per_minute=settings.GATEWAY_RATE_LIMIT_PER_MINUTE
    )
    if retry_after is not None:
        raise GatewayError(
            429, f"Rate limit reached: {settings.GATEWAY_RATE_LIMIT_PER_MINUTE} requests per minute per API key.",
            code="rate_limit_exceeded", retry_after=retry_after,
        )  # fmt: skip


def _prepare_chat(authorization: str | None, raw_body: bytes, team: Team | None = None) -> Route:
    """Everything before forwarding; raises GatewayError. ``team`` is given (and the key check
    skipped) only by ``chat_completions_for_team``, whose caller has checked the session."""
    api_key = _authenticate(authorization) if team is None else None
    if api_key is not None:
        team = api_key.team
    assert team is not None
    request = _parse(raw_body)
    target, servers = _route(team, request.model)
    return Route(api_key, target, servers, bool(request.stream))


class _NotRemembered(Exception):
    """A lookup the fast path needs is not in the lookup memory."""


def _prepare_remembered(authorization: str | None, raw_body: bytes, team: Team | None) -> Route:
    """``_prepare_chat`` from the lookup memory alone, without the database, so it runs on the
    event loop and saves the hop to a database thread. Raises _NotRemembered on a miss, before
    counting the request (``_prepare_chat`` then counts it). The rate-limit count is a cache
    operation: in memory by default, one Redis round trip with CACHE_URL."""
    api_key = None
    if team is None:
        api_key = lookups.api_keys.get(lookups.key_digest(_bearer(authorization)))
        if api_key is None or not ApiKey.team.is_cached(api_key):  # no lazy query on the loop
            raise _NotRemembered
        team = api_key.team
    request = _parse(raw_body)
    remembered = lookups.routes.get((team.pk, request.model))
    if remembered is None:
        raise _NotRemembered
    if api_key is not None:
        _count_request(api_key)
    target, servers = remembered
    return Route(api_key, target, servers, bool(request.stream))


def _parse(raw_body: bytes) -> ChatRequest:
    try:
        body = json.loads(raw_body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GatewayError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from exc
    try:
        return parse_chat_request(body, Limits.shape_only())
    except RequestError as exc:
        raise GatewayError(exc.status, exc.message, code=exc.code, param=exc.param) from exc


def _route(team: Team, model_id: str) -> tuple[routing.Target, list[InferenceServer]]:
    """The checkpoint ``model_id`` names for ``team`` and its live servers, best first;
    remembered briefly (see lookups for what that delays)."""
    remembered = lookups.routes.get((team.pk, model_id))
    if remembered is not None:
        return remembered
    try:
        target = routing.resolve_model(team=team, model_id=model_id)
    except DomainError as exc:
        raise GatewayError(exc.status_code, exc.message, code=exc.code, param=exc.field) from exc
    servers = routing.live_servers(
        base_model=target.base_model, affinity=target.adapter_path or target.model_id
    )
    if not servers:
        raise _no_server(target.base_model.name)
    lookups.routes.put((team.pk, model_id), (target, servers), lookups.cache_seconds())
    return target, servers


def _no_server(base_model: str) -> GatewayError:
    return GatewayError(
        503, f"No inference server for {base_model} is running; retry shortly.",
        code="no_server_available", retry_after=settings.GATEWAY_RETRY_AFTER_S,
    )  # fmt: skip


def _record_usage(route: Route, usage: tuple[int, int] | None) -> None:
    if usage is None or route.api_key is None:
        return
    usage_record(
        api_key=route.api_key,
        model=route.target.model_id,
        checkpoint=route.target.checkpoint,
        prompt_tokens=usage[0],
        completion_tokens=usage[1],
    )


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    if request.method != "POST":
        return GatewayError(405, "Use POST.", code="method_not_allowed").response()
    return await _complete(request.body, request.headers.get("Authorization"), None)


async def chat_completions_for_team(*, team: Team, raw_body: bytes) -> HttpResponseBase:
    """The same completion for a signed-in dashboard user (the checkpoint playground): the caller
    (frontend.playground) has checked the session, its CSRF token and the membership in ``team``."""
    return await _complete(raw_body, None, team)


async def _complete(raw_body: bytes, authorization: str | None, team: Team | None) -> HttpResponseBase:
    try:
        try:
            route = _prepare_remembered(authorization, raw_body, team)
        except _NotRemembered:
            route = await in_db_thread(_prepare_chat)(authorization, raw_body, team)
    except GatewayError as exc:
        return exc.response()
    headers = {
        "Authorization": f"Bearer {settings.INFERENCE_SERVER_TOKEN}",
        "Content-Type": "application/json",
        MODEL_HEADER: route.target.model_id,
    }
    if route.target.adapter_path:
        headers[ADAPTER_HEADER] = route.target.adapter_path
    upstream = None
    for_vllm: vllm.Prepared | None = None  # set when the server that answers is a vLLM one
    for server in route.servers:  # best first; a dead one that still looks alive is skipped
        try:
            if server.engine == "vllm":
                for_vllm = vllm.prepare(
                    raw_body, public_model=route.target.model_id, served_model=route.target.base_model.name,
                    checkpoint=route.target.checkpoint,
                )  # fmt: skip
                upstream = await vllm.complete(server, for_vllm, route.target.checkpoint)
            else:
                for_vllm = None
                upstream = await pool().request(
                    server.url, "/v1/chat/completions", headers=headers, body=raw_body,
                    timeout=settings.GATEWAY_UPSTREAM_TIMEOUT_S,
                )  # fmt: skip
            break
        except UpstreamUnavailable:
            continue
        except UpstreamBroken as exc:
            return GatewayError(
                504, f"The inference server did not answer: {exc}", code="upstream_timeout"
            ).response()
        except vllm.VLLMError as exc:
            return GatewayError(exc.status, exc.message, code=exc.code).response()
    if upstream is None:
        return _no_server(route.target.base_model.name).response()
    if for_vllm is not None:
        return await _vllm_response(upstream, route, for_vllm)

    content_type = upstream.headers.get("content-type", "application/json")
    if route.stream and upstream.status == 200:
        response = StreamingHttpResponse(_relay(upstream, route), status=200, content_type=content_type)
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"  # tell a proxy in front not to buffer either
        return response
    try:
        body = await upstream.read()
    except UpstreamBroken as exc:
        return GatewayError(
            502, f"The inference server failed mid-response: {exc}", code="upstream_error"
        ).response()
    if upstream.status == 200:
        _after_response(_record_usage, route, parse_usage(upstream.headers.get(USAGE_HEADER, "")))
    return HttpResponse(body, status=upstream.status, content_type=content_type)


async def _relay(upstream: UpstreamResponse, route: Route) -> AsyncIterator[bytes]:
    """Pass the server's events through as they arrive; keep our usage comment to ourselves."""
    usage = None
    try:
        async for chunk in upstream.chunks():
            if chunk.startswith(USAGE_COMMENT_PREFIX):
                usage = parse_usage(chunk)
                continue
            yield chunk
    except UpstreamBroken:
        return  # the client sees the stream end without [DONE]
    finally:
        upstream.release()  # closes the connection if the client left before the end
        if usage is not None:
            _after_response(_record_usage, route, usage)


async def _vllm_response(
    upstream: UpstreamResponse, route: Route, prepared: vllm.Prepared
) -> HttpResponseBase:
    """A vLLM server's answer in our shape (see projects.gateway.vllm)."""
    if prepared.stream and upstream.status == 200:
        rewriter = vllm.StreamRewriter(prepared.public_model, prepared.client_wants_usage)
        response = StreamingHttpResponse(_relay_vllm(upstream, route, rewriter), status=200,
                                         content_type="text/event-stream; charset=utf-8")  # fmt: skip
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
        return response
    try:
        body = await upstream.read()
    except UpstreamBroken as exc:
        return GatewayError(
            502, f"The inference server failed mid-response: {exc}", code="upstream_error"
        ).response()
    if upstream.status != 200:
        return JsonResponse(vllm.openai_error(upstream.status, body), status=upstream.status)
    try:
        body, usage = vllm.rewrite_completion(body, prepared.public_model)
    except (ValueError, TypeError) as exc:
        return GatewayError(502, f"The inference server sent an unreadable reply: {exc}",
                            code="upstream_error").response()  # fmt: skip
    _after_response(_record_usage, route, usage)
    return HttpResponse(body, status=200, content_type="application/json")


async def _relay_vllm(
    upstream: UpstreamResponse, route: Route, rewriter: vllm.StreamRewriter
) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.chunks():
            rewritten = rewriter.feed(chunk)
            if rewritten:
                yield rewritten
    except UpstreamBroken:
        return
    finally:
        upstream.release()
        if rewriter.usage is not None:
            _after_response(_record_usage, route, rewriter.usage)


def _list_models(authorization: str | None) -> dict:
    api_key = _authenticate(authorization)
    return {"object": "list", "data": routing.available_models(team=api_key.team)}


def _get_model(authorization: str | None, model_id: str) -> dict:
    api_key = _authenticate(authorization)
    try:
        target = routing.resolve_model(team=api_key.team, model_id=model_id)
    except DomainError as exc:
        raise GatewayError(exc.status_code, exc.message, code=exc.code, param=exc.field) from exc
    checkpoint = target.checkpoint
    created = checkpoint.created_at if checkpoint else target.base_model.created_at
    owner = api_key.team.name if checkpoint else "artweb"
    return {"id": target.model_id, "object": "model", "created": int(created.timestamp()), "owned_by": owner}


async def models(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return GatewayError(405, "Use GET.", code="method_not_allowed").response()
    try:
        return JsonResponse(await in_db_thread(_list_models)(request.headers.get("Authorization")))
    except GatewayError as exc:
        return exc.response()


async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    if request.method != "GET":
        return GatewayError(405, "Use GET.", code="method_not_allowed").response()
    try:
        return JsonResponse(await in_db_thread(_get_model)(request.headers.get("Authorization"), model_id))
    except GatewayError as exc:
        return exc.response()
