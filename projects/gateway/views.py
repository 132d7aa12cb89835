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

Forwarding reads straight through: the route (key, model, live servers, the body parsed once),
then for each server best first its upstream (projects.gateway.upstream: our inference server
or vLLM, one interface) sends the completion, and relays the stream or answers the reply. A
non-streamed reply with logprobs carries each choice's exact token ids (projects.gateway.token_ids).

Errors are OpenAI's error object: bad key 401, bad parameters 400, unknown (or another team's)
model 404, over the rate limit 429 and no live server 503, both with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from projects import metrics
from projects import services as project_services
from projects.access import TeamAccess, resolve_team_and_role
from projects.api import completions
from projects.errors import DomainError
from projects.gateway import balance, capture, lookups, routing, token_ids
from projects.gateway.db import in_db_thread
from projects.gateway.errors import GatewayError
from projects.gateway.http import UpstreamBroken, UpstreamUnavailable
from projects.gateway.ratelimit import rate_limit_hit
from projects.gateway.routing import ParsedChat, Route
from projects.gateway.services import usage_record
from projects.gateway.sync_servers import serve
from projects.gateway.upstream import InferenceServerUpstream, Upstream, Usage
from projects.gateway.vllm import VLLMUpstream
from projects.models import ApiKey, InferenceServer, Team
from projects.selectors.serving import Target, live_servers, names_alias, resolve_model
from training.rollouts import strict_json
from training.serving.protocol import Limits, RequestError, parse_chat_request

_background: set[asyncio.Task] = set()  # strong references until the usage writes finish


def _after_response(func: Callable[..., Any], *args: Any) -> None:
    task = asyncio.get_running_loop().create_task(in_db_thread(func)(*args))
    _background.add(task)
    task.add_done_callback(_background.discard)


def _authenticate(authorization: str | None) -> TeamAccess:
    """The key's team access (projects.access, the resolver every entry point uses); 401 without."""
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
    access = resolve_team_and_role(api_key=api_key)
    assert access is not None
    return access


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


def _prepare_chat(
    authorization: str | None, raw_body: bytes, team: Team | None = None, chat: ParsedChat | None = None
) -> Route:
    """Everything before forwarding; raises GatewayError. ``team`` is given (and the key check
    skipped) only by ``chat_completions_for_team``, whose caller has checked the session;
    ``chat`` when ``_prepare_remembered`` has parsed the body already."""
    access = _authenticate(authorization) if team is None else None
    if access is not None:
        team = access.team
    assert team is not None
    if chat is None:
        chat = _parse(raw_body)
    target, servers = _route(
        team, chat.request.model, capture.conversation_of(chat.store, team.conversation_key)
    )
    route = Route(access.api_key if access else None, target, servers, chat)
    return capture.with_capture(route, capture.capture_for(team, chat.store, chat.decoded, route.api_key))


class _NotRemembered(Exception):
    """A lookup the fast path needs is not in the lookup memory; ``chat`` is the body if it was
    parsed before the miss, so the database path does not parse it again."""

    def __init__(self, chat: ParsedChat | None = None) -> None:
        super().__init__()
        self.chat = chat


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
        access = resolve_team_and_role(api_key=api_key)
        assert access is not None
        team = access.team
    chat = _parse(raw_body)
    remembered = lookups.routes.get((team.pk, chat.request.model))
    if remembered is None:
        raise _NotRemembered(chat)
    if api_key is not None:
        _count_request(api_key)
    target, servers = remembered
    route = Route(api_key, target, servers, chat)
    return capture.with_capture(route, capture.capture_for(team, chat.store, chat.decoded, api_key))


def _parse(raw_body: bytes) -> ParsedChat:
    """The one place the body is decoded and validated."""
    try:
        body = strict_json.loads(
            raw_body
        )  # depth, numbers and strings checked (training.rollouts.strict_json)
    except strict_json.JSONError as exc:
        raise GatewayError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    try:
        request = parse_chat_request(body, Limits.shape_only())
    except RequestError as exc:
        raise GatewayError(exc.status, exc.message, code=exc.code, param=exc.param) from exc
    store = capture.store_fields(body)
    return token_ids.ask_for_token_ids(ParsedChat(raw_body, body, request, store=store))


def _route(
    team: Team, model_id: str, conversation: str | None = None
) -> tuple[Target, list[InferenceServer]]:
    """The checkpoint ``model_id`` names for ``team`` and its live servers, best first;
    remembered briefly (see lookups for what that delays), except ART's latest and model aliases,
    resolved on every request: an alias's canary splits by ``conversation`` (the metadata value
    under the team's conversation key; a request without one is a conversation of its own)."""
    remembered = lookups.routes.get((team.pk, model_id))
    if remembered is not None:
        return remembered
    try:
        target = resolve_model(team=team, model_id=model_id, split_key=conversation or uuid.uuid4().hex)
    except DomainError as exc:
        raise GatewayError(exc.status_code, exc.message, code=exc.code, param=exc.field) from exc
    servers = live_servers(base_model=target.base_model, affinity=target.adapter_path or target.model_id)
    if not servers:
        raise _no_server(target.base_model.name)
    if not routing.names_latest(model_id) and not names_alias(model_id):  # see the docstring
        lookups.routes.put((team.pk, model_id), (target, servers), lookups.cache_seconds())
    return target, servers


def _no_server(base_model: str) -> GatewayError:
    return GatewayError(
        503, f"No inference server for {base_model} is running; retry shortly.",
        code="no_server_available", retry_after=settings.GATEWAY_RETRY_AFTER_S,
    )  # fmt: skip


def _record_usage(route: Route, usage: Usage | None) -> None:
    if usage is not None:
        model = metrics.model_label(route.target.model_id)
        metrics.GATEWAY_TOKENS.labels(model, "prompt").inc(usage[0])
        metrics.GATEWAY_TOKENS.labels(model, "completion").inc(usage[1])
    if usage is None or route.api_key is None:
        return
    usage_record(
        api_key=route.api_key,
        model=route.target.model_id,
        checkpoint=route.target.checkpoint,
        prompt_tokens=usage[0],
        completion_tokens=usage[1],
    )


_stored_list = completions.StoredCompletionsView.as_view({"get": "list"})


def _store(record: capture.Record) -> None:
    project_services.stored_completion_create(**dataclasses.asdict(record))


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    if request.method == "GET":  # the stored completions' list (projects.api.completions)
        return await sync_to_async(_stored_list)(request)
    if request.method != "POST":
        return GatewayError(405, "Use POST (a completion) or GET (stored completions).",
                            code="method_not_allowed").response()  # fmt: skip
    return await serve(request, _complete(request.body, request.headers.get("Authorization"), None))


async def chat_completions_for_team(*, team: Team, raw_body: bytes) -> HttpResponseBase:
    """The same completion for a signed-in dashboard user (the checkpoint playground): the caller
    (frontend.playground) has checked the session, its CSRF token and the membership in ``team``."""
    return await _complete(raw_body, None, team)


async def _complete(raw_body: bytes, authorization: str | None, team: Team | None) -> HttpResponseBase:
    """A completion, timed for Prometheus by model and status (projects.metrics)."""
    started, labels = time.perf_counter(), {"model": "unrouted", "stream": "false"}
    response = await _routed_completion(raw_body, authorization, team, labels)
    metrics.GATEWAY_LATENCY.labels(labels["model"], str(response.status_code), labels["stream"]).observe(
        time.perf_counter() - started
    )
    return response


async def _routed_completion(
    raw_body: bytes, authorization: str | None, team: Team | None, labels: dict[str, str]
) -> HttpResponseBase:
    try:
        try:
            route = _prepare_remembered(authorization, raw_body, team)
        except _NotRemembered as miss:
            route = await in_db_thread(_prepare_chat)(authorization, raw_body, team, miss.chat)
    except GatewayError as exc:
        return exc.response()
    labels["model"] = metrics.model_label(route.target.model_id)
    labels["stream"] = "true" if route.stream else "false"

    def on_usage(usage: Usage) -> None:
        _after_response(_record_usage, route, usage)

    def keep(record: capture.Record) -> None:
        _after_response(_store, record)

    # Least outstanding first, adapter holders preferred (balance); a dead one is skipped.
    for server in balance.order(route.servers, route.target):
        upstream = _upstream(server)
        release = balance.begin(server.url)
        try:
            reply = await upstream.send(route)
        except UpstreamUnavailable:
            release()
            balance.mark_down(server.url)
            continue
        except UpstreamBroken as exc:
            release()
            return GatewayError(
                504, f"The inference server did not answer: {exc}", code="upstream_timeout"
            ).response()
        except BaseException as exc:
            release()
            if isinstance(exc, GatewayError):
                return exc.response()
            raise
        if route.stream and reply.status == 200:
            content_type = upstream.stream_content_type(reply)
            chunks = balance.released_at_end(upstream.relay(reply, route, on_usage), release)
            if route.capture is not None:
                chunks = capture.stored_stream(chunks, route, route.capture, keep)
            response = balance.CountedStream(chunks, release=release, status=200, content_type=content_type)
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"  # tell a proxy in front not to buffer either
            return response
        try:
            answer, usage = await upstream.answer(reply, route)
        except GatewayError as exc:
            return exc.response()
        finally:
            release()
        if route.capture is not None and answer.status_code == 200:
            answer, full = capture.stored_reply(answer, route, route.capture, keep)
            if full is not None:  # the client asked for logprobs: annotated as without storage
                answer = JsonResponse(full)
        answer = token_ids.annotated(answer, route)
        if usage is not None:
            on_usage(usage)
        return answer
    return _no_server(route.target.base_model.name).response()


def _upstream(server: InferenceServer) -> Upstream:
    """The server's dialect: vLLM's own server, or ours (serve_inference's other engines)."""
    return VLLMUpstream(server) if server.engine == "vllm" else InferenceServerUpstream(server)


def _list_models(authorization: str | None) -> dict:
    access = _authenticate(authorization)
    return {"object": "list", "data": routing.available_models(team=access.team)}


def _get_model(authorization: str | None, model_id: str) -> dict:
    access = _authenticate(authorization)
    try:
        target = resolve_model(team=access.team, model_id=model_id)
    except DomainError as exc:
        raise GatewayError(exc.status_code, exc.message, code=exc.code, param=exc.field) from exc
    checkpoint = target.checkpoint
    created = checkpoint.created_at if checkpoint else target.base_model.created_at
    owner = access.team.name if checkpoint else "artweb"
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
