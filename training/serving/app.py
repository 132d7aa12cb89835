"""The inference server's ASGI application: `/v1/chat/completions`, `/v1/models`, `/health`, `/stats`, `/metrics`,
and `/generate` (token ids in: a run's rollouts, training.engines.remote_engine).

A plain ASGI callable (no framework): the routes are few and the hot path stays short. Requests
are validated and rendered on the event loop's side (rendering in a helper thread), sampled by the
scheduler's single generation thread, and answered as JSON or server-sent events. The scheduler is
continuous batching (training.serving.continuous, the default) or, with `scheduler="window"`, the
window scheduler (training.serving.scheduler), kept as the reference that
benchmarks/serving_batching.py measures against. A client that disconnects, streaming or not,
has its request cancelled: it leaves the queue, or the decode batch before the next token.

Trust: every route but GET /health (`ROUTES`) needs `Authorization: Bearer <server token>`, checked
before routing (the gateway holds it; a server without one listens on loopback only); the gateway
names the checkpoint in ADAPTER_HEADER, and only checkpoint directories under `adapter_root` are
ever loaded.

Why one module of this length: the server's routes, their validation and the streaming answers,
without a framework on the hot path; the schedulers, rendering and protocol are modules of their
own.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from training.engines.base import Choice, Engine, OnToken, SamplingParams, TokenDelta
from training.engines.decode import row_seed
from training.engines.grammar import json_grammar
from training.engines.token_wire import TokenRequestError, choice_body, parse_prompts, parse_sampling
from training.rollouts import strict_json
from training.rollouts.agent import template_supports_tools
from training.serving import metrics
from training.serving.adapters import AdapterCache, check_adapter_path
from training.serving.asgi import disconnected as _disconnected
from training.serving.asgi import event as _event
from training.serving.asgi import json_response as _json
from training.serving.asgi import read_body
from training.serving.chunks import (
    ChunkContext,
    choice_chunks,
    finish_chunk,
    first_chunks,
    sse_event,
    token_chunk,
)
from training.serving.continuous import ContinuousScheduler, DecodeBatchLike
from training.serving.fetch_cache import FetchedCheckpoints
from training.serving.prompts import render_prompt
from training.serving.protocol import (
    ADAPTER_HEADER,
    ADAPTER_KEY_HEADER,
    ADAPTER_SHA256_HEADER,
    DONE_EVENT,
    MODEL_HEADER,
    USAGE_HEADER,
    ChatRequest,
    Limits,
    RequestError,
    ResponseFormat,
    parse_chat_request,
    usage_comment,
)
from training.serving.responses import completion_body, new_completion_id, usage_body
from training.serving.scheduler import BatchScheduler
from training.wire.openai_errors import error_object

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_TOKEN_PROMPTS = 4096  # prompts in one POST /generate (a run step's rollouts of one turn)
SCHEDULERS = ("continuous", "window")
# Every (method, path) served besides GET /health, and its handler; all need the server token
# (tests walk this table: none answers without it).
ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/chat/completions"): "_route_chat",
    ("POST", "/generate"): "_route_generate",
    ("GET", "/metrics"): "_route_metrics",
    ("GET", "/v1/models"): "_route_models",
    ("GET", "/stats"): "_route_stats",
}


@dataclass
class ServerConfig:
    model_name: str  # the base model's catalogue name; requests without an adapter must use it
    adapter_root: Path  # only checkpoints under this directory are loaded
    token: str = ""  # bearer token required on every route but /health ("" = none)
    limits: Limits = field(default_factory=Limits)
    batch_window_s: float = 0.01
    max_batch_size: int = 32  # sequences per engine call
    adapter_capacity: int = 8  # adapters kept loaded
    context_length: int | None = None  # prompt + max_tokens must fit
    scheduler: str = "continuous"  # or "window" (see the module doc)
    # (key, sha256) of a stored checkpoint -> a verified local folder under adapter_root (it may
    # download; FileNotFoundError: no such checkpoint). None: only ADAPTER_HEADER's path is used.
    adapter_fetch: Callable[[str, str], Path] | None = None
    # Where adapter_fetch downloads to (a folder no trainer writes into): what is there is counted
    # against fetch_cache_budget_bytes and evicted least recently used first (0: no budget).
    # None: fetched folders are the store's own (the local store) and are never evicted.
    fetch_cache_root: Path | None = None
    fetch_cache_budget_bytes: int = 0


class InferenceApp:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.adapters = AdapterCache(engine, config.adapter_capacity)
        self.fetched = FetchedCheckpoints(
            self._fetch, root=config.fetch_cache_root, budget_bytes=config.fetch_cache_budget_bytes
        )
        self.scheduler: ContinuousScheduler | BatchScheduler
        if config.scheduler == "continuous":
            self.scheduler = ContinuousScheduler(
                self._new_decode_batch, window_s=config.batch_window_s, max_batch_size=config.max_batch_size
            )
        elif config.scheduler == "window":
            self.scheduler = BatchScheduler(
                self._generate, window_s=config.batch_window_s, max_batch_size=config.max_batch_size
            )
        else:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}, got {config.scheduler!r}")
        self.native_tools = template_supports_tools(self.tokenizer)
        self.started_at = time.time()
        self._scheduler_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ generation thread
    def _generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapter: Path | None,
        on_token: OnToken | None = None,
        grammars: list[str | None] | None = None,
    ) -> list[Choice]:
        name = self._adapter_name(adapter)
        extra: dict[str, Any] = {"grammars": grammars} if grammars is not None else {}
        return self.engine.generate_from_tokens(prompts, sampling, adapter=name, on_token=on_token, **extra)

    def _new_decode_batch(self, adapter: Path | None) -> DecodeBatchLike:
        from training.engines.decode import DecodeBatch
        from training.engines.transformers_engine import TransformersEngine

        if not isinstance(self.engine, TransformersEngine):
            raise TypeError("continuous batching needs the transformers engine (use scheduler='window')")
        return DecodeBatch(self.engine, self._adapter_name(adapter))

    def _adapter_name(self, adapter: Path | None) -> str | None:
        """The loaded adapter's name (loading it if need be); on the generation thread."""
        name = None
        if adapter is not None:
            try:
                name = self.adapters.acquire(adapter)
            except FileNotFoundError as exc:
                raise RequestError(str(exc), code="model_not_found", status=404) from exc
            except Exception as exc:  # e.g. an adapter trained on another base model
                log.exception("cannot load adapter %s", adapter)
                raise RequestError(f"cannot load the checkpoint: {exc}", code="adapter_load_failed",
                                   status=500) from exc  # fmt: skip
        return name

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        method, path = scope["method"], scope["path"]
        started = False
        status = 0
        send_to_client = send

        async def send_tracked(message: dict[str, Any]) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started, status = True, int(message["status"])
            await send_to_client(message)

        send = send_tracked
        try:
            try:
                if (method, path) == ("GET", "/health"):  # the one open route: liveness, nothing else
                    await _json(send, 200, {"status": "ok", "model": self.config.model_name})
                    return
                if not self._authorized(headers):  # before routing: an unknown path is a 401 too
                    raise RequestError("a valid server token is required", code="invalid_api_key", status=401)
                handler = ROUTES.get((method, path))
                if handler is None:
                    raise RequestError(f"no route {method} {path}", code="not_found", status=404)
                await getattr(self, handler)(headers, receive, send)
            except RequestError as exc:
                await _json(send, exc.status, exc.body())
            except Exception:
                # Anything unforeseen is still OpenAI's error object (the gateway relays it), unless a
                # stream had begun: then the connection is cut, as a half-sent stream cannot turn into one.
                log.exception("unhandled error on %s %s", method, path)
                if started:
                    raise
                await _json(send, 500, error_object(500, "The inference server had an error; see its log."))
        finally:
            if path == "/v1/chat/completions":  # 499: the client left before any response
                metrics.REQUESTS.labels(str(status or 499)).inc()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._scheduler_task = asyncio.create_task(self.scheduler.run())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._scheduler_task is not None:
                    self._scheduler_task.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route_chat(self, headers: dict[str, str], receive: Any, send: Any) -> None:
        await self._chat(headers, await read_body(receive, MAX_BODY_BYTES), send, receive)

    async def _route_generate(self, headers: dict[str, str], receive: Any, send: Any) -> None:
        await self._generate_tokens(headers, await read_body(receive, MAX_BODY_BYTES), send, receive)

    async def _route_metrics(self, headers: dict[str, str], receive: Any, send: Any) -> None:
        body, content_type = metrics.exposition()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type.encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def _route_models(self, headers: dict[str, str], receive: Any, send: Any) -> None:
        model = {"id": self.config.model_name, "object": "model", "created": int(self.started_at),
                 "owned_by": "artweb"}  # fmt: skip
        await _json(send, 200, {"object": "list", "data": [model]})

    async def _route_stats(self, headers: dict[str, str], receive: Any, send: Any) -> None:
        await _json(send, 200, self.stats())

    def _authorized(self, headers: dict[str, str]) -> bool:
        if not self.config.token:  # served on loopback only (training.serving.binding)
            return True
        given = headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self.config.token.encode())

    def stats(self) -> dict[str, Any]:
        return {
            "model": self.config.model_name,
            "uptime_s": round(time.time() - self.started_at, 1),
            "queued_requests": self.scheduler.queued,
            "running_requests": self.scheduler.running,
            "scheduler": self.config.scheduler,
            "batch_window_ms": self.config.batch_window_s * 1000,
            "max_batch_size": self.config.max_batch_size,
            **self.scheduler.stats.as_dict(),
            "adapters": {
                "capacity": self.adapters.capacity,
                "loaded": self.adapters.loaded(),
                "loads": self.adapters.loads,
                "evictions": self.adapters.evictions,
            },
            "checkpoint_cache": self.fetched.stats(),
        }

    async def _adapter_path(self, headers: dict[str, str]) -> Path:
        """The checkpoint folder a request names: a stored checkpoint (key + digest) fetched into
        the local cache once (off the event loop: it may download), else the path header."""
        key, sha256 = headers.get(ADAPTER_KEY_HEADER, ""), headers.get(ADAPTER_SHA256_HEADER, "")
        if not (key and sha256 and self.config.adapter_fetch is not None):
            if not headers.get(ADAPTER_HEADER):
                raise RequestError(
                    "this server cannot fetch stored checkpoints", code="model_not_found", status=404
                )
            return check_adapter_path(headers[ADAPTER_HEADER], self.config.adapter_root)
        try:  # a cached checkpoint is answered here; only a download goes to a thread
            folder = self.fetched.cached(key, sha256)
            if folder is None:
                folder = await asyncio.get_running_loop().run_in_executor(None, self.fetched.get, key, sha256)
        except FileNotFoundError:
            raise RequestError("the checkpoint's files are missing in storage",
                               code="model_not_found", status=404) from None  # fmt: skip
        except Exception as exc:  # a digest that does not match, an unreachable bucket
            log.exception("cannot fetch checkpoint %s", key)
            raise RequestError(f"cannot fetch the checkpoint: {exc}", code="adapter_fetch_failed",
                               status=502) from None  # fmt: skip
        root = self.fetched.root
        return check_adapter_path(
            str(folder),
            root if root is not None and folder.is_relative_to(root) else self.config.adapter_root,
        )

    def _fetch(self, key: str, sha256: str) -> Path:
        if self.config.adapter_fetch is None:
            raise RequestError(
                "this server cannot fetch stored checkpoints", code="model_not_found", status=404
            )
        return self.config.adapter_fetch(key, sha256)

    def loaded_checkpoints(self) -> list[str]:
        """The adapters loaded now, least recently used first, each named by its store key when it
        was fetched (the same name on every host: the gateway prefers a server that holds it),
        else by its path."""
        return [self.fetched.key_of(Path(path)) or path for path in self.adapters.loaded()]

    # ------------------------------------------------------------------ chat completions
    async def _chat(self, headers: dict[str, str], raw: bytes, send: Any, receive: Any = None) -> None:
        try:
            body = strict_json.loads(raw)
        except strict_json.JSONError as exc:
            raise RequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        request = parse_chat_request(body, self.config.limits)
        adapter: Path | None = None
        named = unquote(headers.get(MODEL_HEADER) or "")  # percent-encoded: a client's name may be any text
        if headers.get(ADAPTER_HEADER) or headers.get(ADAPTER_KEY_HEADER):
            adapter = await self._adapter_path(headers)
            model = named or request.model
        elif request.model == self.config.model_name:
            model = request.model
        elif named:  # a checkpoint without an adapter (a client model's step 0)
            model = named  # is the base model: the gateway names it, we answer
        else:
            raise RequestError(f"The model `{request.model}` does not exist on this server",
                               param="model", code="model_not_found", status=404)  # fmt: skip
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(None, self._render, request)
        grammar = None
        if request.response_format is not None:  # compiling may take a while: off the event loop
            grammar = await loop.run_in_executor(None, self._grammar, request.response_format)
        limit = self.config.context_length
        if limit is not None and len(prompt) + request.max_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens; the messages take "
                f"{len(prompt)} and max_tokens asks for {request.max_tokens}.",
                param="messages", code="context_length_exceeded",
            )  # fmt: skip
        sampling = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            max_new_tokens=request.max_tokens,
            stop=list(request.stop),
            seed=request.seed,
            top_logprobs=request.top_logprobs if request.logprobs else 0,
            top_k=request.top_k,
            min_p=request.min_p,
        )
        if request.stream:
            await self._stream(request, model, prompt, sampling, adapter, send, receive, grammar)
            return
        sampled = asyncio.ensure_future(self._sample(request, prompt, sampling, adapter, grammar=grammar))
        if not await _finished_unless_client_left(sampled, receive):
            return
        choices = await sampled
        response = completion_body(
            request, choices, completion_id=new_completion_id(), created=int(time.time()), model=model,
            prompt_token_ids=prompt, token_text=self._token_text,
        )  # fmt: skip
        usage = response["usage"]
        metrics.TOKENS.inc(usage["completion_tokens"])
        await _json(
            send, 200, response, {USAGE_HEADER: f"{usage['prompt_tokens']} {usage['completion_tokens']}"}
        )

    # ------------------------------------------------------------------ token ids in, choices out
    async def _generate_tokens(
        self, headers: dict[str, str], raw: bytes, send: Any, receive: Any = None
    ) -> None:
        """POST /generate (training.engines.token_wire): prompts as token ids, one Choice each with
        its token ids and logprobs, under the checkpoint the headers name (as for chat) or the base
        model. What a run's rollouts on the inference servers send (training.engines.remote_engine):
        each prompt is a request of its own in the scheduler, so they batch with everyone else's;
        a seeded request's row i draws from ``row_seed(seed, i)``, as one engine call's rows do."""
        try:
            body = strict_json.loads(raw)
        except strict_json.JSONError as exc:
            raise RequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        try:
            prompts = parse_prompts(body.get("prompts"), vocabulary=len(self.tokenizer))
            sampling = parse_sampling(body.get("sampling"))
        except TokenRequestError as exc:
            raise RequestError(exc.message, param=exc.param) from None
        if len(prompts) > MAX_TOKEN_PROMPTS:
            raise RequestError(f"at most {MAX_TOKEN_PROMPTS} prompts per request", param="prompts")
        if sampling.max_new_tokens > self.config.limits.max_tokens:
            raise RequestError(f"max_new_tokens may be at most {self.config.limits.max_tokens} on this server",
                               param="sampling.max_new_tokens")  # fmt: skip
        limit = self.config.context_length
        longest = max(len(prompt) for prompt in prompts)
        if limit is not None and longest + sampling.max_new_tokens > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens; a prompt takes {longest} and "
                f"max_new_tokens asks for {sampling.max_new_tokens}.",
                param="prompts", code="context_length_exceeded",
            )  # fmt: skip
        adapter = None
        if headers.get(ADAPTER_HEADER) or headers.get(ADAPTER_KEY_HEADER):
            adapter = await self._adapter_path(headers)
        rows = [
            replace(sampling, seed=row_seed(sampling.seed, index)) if sampling.seed is not None else sampling
            for index in range(len(prompts))
        ]
        sampled: asyncio.Future[list[list[Choice]]] = asyncio.ensure_future(
            asyncio.gather(
                *(self._submit([prompt], row, adapter) for prompt, row in zip(prompts, rows, strict=True))
            )
        )
        if not await _finished_unless_client_left(sampled, receive):
            return
        choices = [answer[0] for answer in await sampled]
        metrics.TOKENS.inc(sum(len(choice.token_ids) for choice in choices))
        await _json(send, 200, {"choices": [choice_body(choice) for choice in choices],
                                "stop_token_ids": sorted(self.engine.stop_token_ids)})  # fmt: skip

    async def _submit(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapter: Path | None,
        on_token: OnToken | None = None,
        grammar: str | None = None,
    ) -> list[Choice]:
        """The scheduler's answer; an engine failure is a 500 in OpenAI's shape (logged)."""
        try:
            return await self.scheduler.submit(prompts, sampling, adapter, on_token, grammar)
        except RequestError:
            raise
        except Exception as exc:
            log.exception("generation failed")
            raise RequestError(f"generation failed: {exc}", code="server_error", status=500) from exc

    def _render(self, request: ChatRequest) -> list[int]:
        return render_prompt(self.tokenizer, request, native_tools=self.native_tools)

    def _grammar(self, response_format: ResponseFormat) -> str:
        """The grammar that constrains a reply to `response_format`, checked against the engine."""
        try:
            grammar = json_grammar(response_format.schema)
            self.engine.check_grammar(grammar)
        except NotImplementedError as exc:
            raise RequestError(f"response_format {response_format.type} is not supported by this "
                               f"server's engine", param="response_format", code="unsupported_value") from exc  # fmt: skip
        except ValueError as exc:
            raise RequestError(f"response_format: the schema cannot be used for constrained decoding: {exc}",
                               param="response_format") from exc  # fmt: skip
        return grammar

    async def _sample(
        self,
        request: ChatRequest,
        prompt: list[int],
        sampling: SamplingParams,
        adapter: Path | None,
        on_token: OnToken | None = None,
        grammar: str | None = None,
    ) -> list[Choice]:
        return await self._submit([prompt] * request.n, sampling, adapter, on_token, grammar)

    async def _stream(
        self,
        request: ChatRequest,
        model: str,
        prompt: list[int],
        sampling: SamplingParams,
        adapter: Path | None,
        send: Any,
        receive: Any = None,
        grammar: str | None = None,
    ) -> None:
        context = ChunkContext(request, new_completion_id(), int(time.time()), model)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        ]})  # fmt: skip
        for chunk in first_chunks(context):
            if request.return_token_ids:
                chunk["prompt_token_ids"] = prompt
            await _event(send, sse_event(chunk))
        # Without tools each token goes out as it is sampled, while the rest of the batch goes
        # on. With tools a choice may turn out to be a tool call, known only at its end: its
        # chunks are sent when it is complete.
        live = not request.uses_tools
        tokens: asyncio.Queue[TokenDelta | None] = asyncio.Queue()
        arrived, first_token = time.perf_counter(), True

        def on_token(delta: TokenDelta) -> None:
            nonlocal first_token
            if first_token:
                first_token = False
                metrics.TIME_TO_FIRST_TOKEN.observe(time.perf_counter() - arrived)
            tokens.put_nowait(delta)

        sampled = asyncio.ensure_future(
            self._sample(request, prompt, sampling, adapter, on_token if live else None, grammar)
        )
        sampled.add_done_callback(lambda _: tokens.put_nowait(None))
        # A client that goes away (the gateway closes the connection when its own client does)
        # ends the stream; a request still queued is dropped rather than sampled for no one.
        gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        if gone is not None:
            gone.add_done_callback(lambda _: tokens.put_nowait(None))
        try:
            while (delta := await tokens.get()) is not None:
                await _event(send, sse_event(token_chunk(context, delta, self._token_text)))
                if delta.finish_reason is not None:
                    await _event(send, sse_event(finish_chunk(context, delta.index, delta.finish_reason)))
            if gone is not None and gone.done():
                return
            choices = sampled.result()
        except RequestError as exc:
            # The status line has gone out; OpenAI's streams report a late error as an event.
            await _event(send, sse_event(exc.body()))
            await send({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})
            return
        finally:
            if not sampled.done():  # the client went away: drop the request if it has not run yet
                sampled.cancel()
            if gone is not None and not gone.done():
                gone.cancel()
        if not live:
            for index, choice in enumerate(choices):
                for chunk in choice_chunks(
                    context, index, choice, decode=self._decode, token_text=self._token_text
                ):
                    await _event(send, sse_event(chunk))
        usage = usage_body(len(prompt), choices)
        metrics.TOKENS.inc(usage["completion_tokens"])
        if request.include_usage:
            await _event(send, sse_event(context.chunk([], usage=usage)))
        await _event(send, usage_comment(usage["prompt_tokens"], usage["completion_tokens"]))
        await send({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


async def _finished_unless_client_left(sampled: asyncio.Future[Any], receive: Any) -> bool:
    """Wait for ``sampled``; a client that goes away first takes its request out of the queue or
    the decode batch (``sampled`` is cancelled). Whether it finished."""
    if receive is None:
        return True
    gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait([sampled, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not sampled.done():
            sampled.cancel()
        gone.cancel()
    return sampled.done() and not sampled.cancelled()
