"""The Tinker API's routes, as the ``tinker`` SDK (0.38) calls them under ``{base_url}/api/v1/``.

Keys: ``X-API-Key: tml-<team API key>`` (the SDK refuses keys without the ``tml-`` prefix; artweb
strips it). A read-only key reads (clients, checkpoints, futures, weights info); whatever changes
state needs a read-write key: sessions, heartbeats and finishing them, sampling (it creates rows and
queues work on the shared trainer), cancelling, training, saves and telemetry. The key resolves
through projects.access like the REST API's, and every row is read through projects.selectors
(``scoped``: the model's ``TEAM_PATH``) and written through projects.services, never queried here:
everything a team did not create is a 404, whatever exists. Errors are 4xx with
OpenAI's error object (the SDK shows its message); a request that fails while it runs is a failed
future (``{"error", "category"}``), which the SDK raises as ``RequestFailedError``.

Training requests (``forward_backward``, ``optim_step``, saves, loads) become futures a worker runs
in ``seq_id`` order (projects.jobs.tinker); ``retrieve_future`` holds the poll until the result is
there or ``TINKER_POLL_S`` passes (then ``try_again``: the SDK asks again at once).

Why one module of this length: one thin handler per route the SDK calls (about thirty), in the SDK's
order; they hold no logic (reads in projects.selectors, writes in projects.services).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from projects import selectors, services
from projects.access import Permission, TeamAccess, resolve_team_and_role
from projects.content_encoding import ZSTD, decoded_body
from projects.errors import DomainError, NotFound, RateLimited, ValidationFailed
from projects.models import (
    BaseModel,
    TinkerFuture,
    TinkerFutureStatus,
    TinkerModel,
    TinkerSampler,
    TinkerSession,
)
from projects.selectors.tinker_paths import checkpoint_for_path
from training.rollouts import strict_json
from training.wire.openai_errors import error_object
from training.wire.tinker_http import PROTOBUF, WireError

KEY_PREFIX = "tml-"
CLIENT_CONFIG = {
    # What this server does not offer, switched off in the SDK: its pyqwest transport (httpx is
    # enough), parallel forward_backward chunks (one session runs one request at a time anyway),
    # zstd request bodies, the batched retrieve_futures poll, server-side custom losses (the SDK then
    # runs forward_backward_custom client-side over forward + a linear loss) and sampling-session joins.
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "pjwt_auth_enabled": False,
}


class _Denied(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def _error(status: int, message: str, param: str | None = None) -> JsonResponse:
    return JsonResponse(error_object(status, message, param=param), status=status)


def _access(request: HttpRequest) -> TeamAccess:
    raw = request.headers.get("X-API-Key", "")
    if not raw:
        bearer = request.headers.get("Authorization", "")
        raw = bearer[7:] if bearer.startswith("Bearer ") else ""
    if not raw:
        raise _Denied(401, "send your key as X-API-Key: tml-<artweb API key>")
    key = services.api_key_authenticate(raw=raw[len(KEY_PREFIX) :] if raw.startswith(KEY_PREFIX) else raw)
    if key is None:
        raise _Denied(401, "invalid or revoked API key (the Tinker SDK takes tml- followed by an artweb key)")
    access = resolve_team_and_role(api_key=key)  # the one resolver and role table (REST API, dashboard)
    assert access is not None  # a key always acts for its own team
    return access


def endpoint(
    *methods: str, write: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., HttpResponse]]:
    def wrap(view: Callable[..., Any]) -> Callable[..., HttpResponse]:
        @csrf_exempt
        @wraps(view)
        def handle(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                return _error(405, f"use {' or '.join(methods)} here")
            try:
                access = _access(request)
                if write and not access.allows(Permission.WRITE):
                    raise _Denied(
                        403,
                        "a read-only key cannot change state (sessions, sampling, training, "
                        "saves): use a read-write key",
                    )
                answer = view(request, access, *args, **kwargs)
            except _Denied as exc:
                return _error(exc.status, str(exc), exc.param)
            except DomainError as exc:
                response = _error(exc.status_code, str(exc), exc.field)
                if isinstance(exc, RateLimited):  # a fair share of the trainer (issue 51)
                    response["Retry-After"] = str(exc.retry_after_s)
                return response
            except WireError as exc:
                return _error(400, str(exc), exc.param)
            return answer if isinstance(answer, HttpResponse) else JsonResponse(answer)

        return handle

    return wrap


def _body(request: HttpRequest) -> bytes:
    limit = settings.PREVIEW_MAX_BODY_BYTES
    data = request.read(limit + 1)
    if len(data) > limit:
        raise _Denied(413, f"the body is over {limit} bytes (PREVIEW_MAX_BODY_BYTES)")
    # Decoded as a stream and stopped at the same limit, whatever the frame declares (issue 51).
    return decoded_body(data, request.headers.get("Content-Encoding"), limit=limit,
                        setting="PREVIEW_MAX_BODY_BYTES", accepted=(ZSTD,))  # fmt: skip


def _json(request: HttpRequest) -> dict[str, Any]:
    """The body through the one strict reader (training.rollouts.strict_json): depth, NaN, 1e400, integers
    past 64 bits, lone surrogates and NUL are a 400 naming the position, never a 500 later."""
    try:
        value = strict_json.loads(_body(request) or b"{}", allow_nul=False)
    except strict_json.JSONError as exc:
        raise ValidationFailed(f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValidationFailed("the body must be a JSON object")
    return value


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ValidationFailed("is required (a non-empty string)", field=name)
    return value


def _session(access: TeamAccess, session_id: Any) -> TinkerSession:
    session = selectors.tinker_session_get(team=access.team, session_id=session_id)
    if session is None:
        raise NotFound(f"no session {session_id!r}", field="session_id")
    return session


def _model(access: TeamAccess, model_id: Any) -> TinkerModel:
    model = selectors.tinker_model_get(team=access.team, model_id=model_id)
    if model is None:
        raise NotFound(f"no training client {model_id!r}", field="model_id")
    return model


def _future_reply(future: TinkerFuture, model: TinkerModel | None = None, **extra: Any) -> dict[str, Any]:
    return {"request_id": future.pk, **({"model_id": model.pk} if model else {}), **extra}


# ---------------------------------------------------------------------- service
@csrf_exempt
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@endpoint("POST")
def client_config(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    return dict(CLIENT_CONFIG)


@endpoint("POST")
def client_dynamic_config(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    """The flags the SDK re-reads while it runs: an abandoned sample is cancelled (``cancel_future``)."""
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}


@endpoint("POST", write=True)
def telemetry(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    """The SDK's own error reports: accepted and dropped (artweb keeps its own logs)."""
    _body(request)
    return {"status": "accepted"}


@endpoint("GET")
def server_capabilities(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    from training.model_files import context_length

    models = []
    for base in selectors.base_models_by_name():
        try:
            length = context_length(base.source, settings.MODEL_CACHE_DIR)
        except Exception:  # noqa: BLE001 (a catalogue entry this host cannot read: say nothing of it)
            length = None
        models.append(
            {"model_name": base.name, "max_context_length": length, "trainable": True, "sampleable": True}
        )
    return {"supported_models": models}


@endpoint("POST", write=True)
def create_session(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    body = _json(request)
    tags = body.get("tags") or []
    if not isinstance(tags, list):
        raise ValidationFailed("must be a list of strings", field="tags")
    metadata = body.get("user_metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValidationFailed("must be an object", field="user_metadata")
    session = services.tinker_session_create(
        team=access.team, project=body.get("project_id") or None, tags=tags, user_metadata=metadata,
        sdk_version=str(body.get("sdk_version") or ""),
    )  # fmt: skip
    return {"type": "create_session", "session_id": session.pk}


@endpoint("POST", write=True)
def session_heartbeat(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    services.tinker_session_heartbeat(session=_session(access, _json(request).get("session_id")))
    return {"type": "session_heartbeat"}


@endpoint("GET")
def session_detail(request: HttpRequest, access: TeamAccess, session_id: str) -> dict[str, Any]:
    session = _session(access, session_id)
    return {
        "training_run_ids": selectors.tinker_session_training_run_ids(session=session),
        "sampler_ids": selectors.tinker_session_sampler_ids(session=session),
        "user_metadata": session.user_metadata or None,
    }


@endpoint("POST", write=True)
def session_finish(request: HttpRequest, access: TeamAccess, session_id: str) -> dict[str, Any]:
    """The SDK's ``ServiceClient.close()`` (a ``with`` block's end): the session's runs end."""
    session = _session(access, session_id)
    body = _json(request)
    given = body.get("reason")
    reason: dict[str, Any] = given if isinstance(given, dict) else {}
    services.tinker_session_finish(session=session, reason=str(reason.get("type") or "closed"),
                                   detail=str(body.get("detail") or ""))  # fmt: skip
    return {}


# ---------------------------------------------------------------------- training clients
@endpoint("POST", write=True)
def create_model(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    body = _json(request)
    session = _session(access, body.get("session_id"))
    seq = body.get("model_seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValidationFailed("must be an integer of 0 or more", field="model_seq_id")
    optimizer = body.get("optimizer_config") or {}
    if isinstance(optimizer, dict) and optimizer.get("type", "adam") not in ("adam", "adamw"):
        raise ValidationFailed(f"optimizer {optimizer.get('type')!r} is not offered: artweb trains with AdamW",
                               field="optimizer_config")  # fmt: skip
    model = services.tinker_model_create(
        session=session, model_seq_id=seq, base_model=_text(body, "base_model"), lora_config=body.get("lora_config"),
        user_metadata=body.get("user_metadata"),
    )  # fmt: skip
    future = services.tinker_future_done(
        team=access.team, kind="create_model", result={"type": "create_model", "model_id": model.pk}
    )
    return _future_reply(future, model)


@endpoint("POST")
def get_info(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    model = _model(access, _json(request).get("model_id"))
    base = model.model.base_model
    from pathlib import Path

    tokenizer = base.source if Path(base.source).is_dir() else None
    return {
        "type": "get_info", "model_id": model.pk, "model_name": base.name, "is_lora": True,
        "lora_rank": model.model.lora.get("rank"),
        "model_data": {"model_name": base.name, "arch": "causal_lm", "tokenizer_id": tokenizer},
    }  # fmt: skip


def _submit(access: TeamAccess, kind: str, body: dict[str, Any], *, blob: bytes | None = None,
            model_id: Any = None, seq_id: Any = None) -> dict[str, Any]:  # fmt: skip
    model = _model(access, model_id if model_id is not None else body.get("model_id"))
    seq = seq_id if seq_id is not None else body.get("seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise ValidationFailed("must be an integer of 1 or more (the SDK numbers a client's requests)",
                               field="seq_id")  # fmt: skip
    future = services.tinker_future_submit(team=access.team, kind=kind, model=model, seq_id=seq, payload=body,
                                           body=blob)  # fmt: skip
    return _future_reply(future, model)


@endpoint("POST", write=True)
def forward_backward(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    from tinker.proto import tinker_public_pb2 as pb

    if PROTOBUF not in request.headers.get("Content-Type", ""):
        raise ValidationFailed(f"send the request as {PROTOBUF} (the tinker SDK does)")
    blob = _body(request)
    head = pb.ForwardBackwardRequest()
    try:
        head.ParseFromString(blob)
    except Exception as exc:  # noqa: BLE001
        raise ValidationFailed(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    if not head.data:
        raise ValidationFailed("data must hold at least one datum", field="data")
    _check_datum_tokens(_model(access, head.model_id).model.base_model, blob)
    kind = "forward_backward"
    return _submit(access, kind, {"forward_only": head.forward_only}, blob=blob, model_id=head.model_id,
                   seq_id=int(head.seq_id))  # fmt: skip


def _check_datum_tokens(base: BaseModel, blob: bytes) -> None:
    """Every datum's input and target ids in the base model's vocabulary, refused here (400 naming
    the datum and position) before the call is queued; the session checks again for every caller."""
    from training.session.contract import LossInputError, check_token_ids
    from training.wire.tinker import parse_forward_backward

    vocabulary = _vocabulary(base)
    if vocabulary is None:
        return
    call = parse_forward_backward(blob)  # a WireError is a 400 naming the part
    try:
        check_token_ids(call.data, vocabulary)
    except LossInputError as exc:
        raise ValidationFailed(str(exc), field=str(exc).split(":", 1)[0]) from None


@endpoint("POST", write=True)
def optim_step(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    body = _json(request)
    params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")
    if not isinstance(params, dict):
        raise ValidationFailed("is required", field="adam_params")
    rate = params.get("learning_rate", 1e-4)
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < 1:
        raise ValidationFailed("must be a number in [0, 1)", field="adam_params.learning_rate")
    return _submit(access, "optim_step", body)


@endpoint("POST", write=True)
def save_weights(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    return _submit(access, "save_weights", _checked_name(_json(request)))


@endpoint("POST", write=True)
def save_weights_for_sampler(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    return _submit(access, "save_weights_for_sampler", _checked_name(_json(request)))


def _checked_name(body: dict[str, Any]) -> dict[str, Any]:
    """A save's body: its name, and its TTL (any saved name may expire: projects.tinker.exports)."""
    from projects.tinker.exports import check_ttl

    name = body.get("path")
    if name is not None and (not isinstance(name, str) or not name or "/" in name or len(name) > 100):
        raise ValidationFailed("a name without '/', up to 100 characters", field="path")
    check_ttl(body.get("ttl_seconds"))
    return body


@endpoint("POST", write=True)
def load_weights(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    body = _json(request)
    no_access_tokens(request, body)
    checkpoint = checkpoint_for_path(access.team, str(body.get("path") or ""), param="path", public=True)
    if body.get("model_id"):
        return _submit(access, "load_weights", body)
    # Create-via-load: a new training client from the checkpoint (its base model and LoRA shape).
    session = _session(access, body.get("session_id"))
    seq = body.get("model_seq_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ValidationFailed("must be an integer of 0 or more", field="model_seq_id")
    model = services.tinker_model_create(
        session=session, model_seq_id=seq, base_model=checkpoint.model.base_model.name, lora_config=None,
        lora=checkpoint.model.lora,
    )  # fmt: skip
    future = services.tinker_future_submit(
        team=access.team, kind="load_weights", model=model, seq_id=0, payload=body
    )
    return _future_reply(future, model)


def no_access_tokens(request: HttpRequest, body: dict[str, Any]) -> None:
    """A weights access token (another account's checkpoint) is not how artweb crosses teams."""
    if body.get("weights_access_token") or request.headers.get("X-Tinker-Weights-Access-Token"):
        raise ValidationFailed("is not offered: another team's checkpoint is readable once its team publishes "
                               "it (publish_checkpoint_from_tinker_path)", field="weights_access_token")  # fmt: skip


# ---------------------------------------------------------------------- sampling
@endpoint("POST", write=True)
def create_sampling_session(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    body = _json(request)
    session = _session(access, body.get("session_id"))
    sampler = _sampler_for(
        access, session, body, sampler_id=f"{session.pk}:sample:{body.get('sampling_session_seq_id')}"
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampler.pk}


def _sampler_for(
    access: TeamAccess, session: TinkerSession, body: dict[str, Any], *, sampler_id: str | None
) -> TinkerSampler:
    path = body.get("model_path")
    if path:
        checkpoint = checkpoint_for_path(access.team, path, param="model_path", public=True)
        return services.tinker_sampler_create(session=session, sampler_id=sampler_id,
                                              base_model=checkpoint.model.base_model, checkpoint=checkpoint,
                                              model_path=path)  # fmt: skip
    name = body.get("base_model")
    base = selectors.base_model_named(name) if isinstance(name, str) else None
    if base is None:
        raise ValidationFailed(
            f"name a base model artweb offers or a model_path (got {name!r})", field="base_model"
        )
    return services.tinker_sampler_create(
        session=session, sampler_id=sampler_id, base_model=base, checkpoint=None
    )


@endpoint("GET")
def sampler_detail(request: HttpRequest, access: TeamAccess, sampler_id: str) -> dict[str, Any]:
    sampler = selectors.tinker_sampler_get(team=access.team, sampler_id=sampler_id)
    if sampler is None:
        raise NotFound(f"no sampler {sampler_id!r}")
    return {
        "sampler_id": sampler.pk,
        "base_model": sampler.base_model.name,
        "model_path": sampler.model_path or None,
    }


@endpoint("POST", write=True)
def asample(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    body = _json(request)
    sampler_id = body.get("sampling_session_id")
    if sampler_id:
        sampler = selectors.tinker_sampler_get(team=access.team, sampler_id=sampler_id)
        if sampler is None:
            raise NotFound(f"no sampling session {sampler_id!r}", field="sampling_session_id")
    else:
        session = selectors.tinker_session_latest(team=access.team)
        if session is None:
            raise ValidationFailed("create a session first", field="sampling_session_id")
        sampler = _sampler_for(access, session, body, sampler_id=None)
    num = body.get("num_samples", 1)
    if not isinstance(num, int) or isinstance(num, bool) or not 1 <= num <= 64:
        raise ValidationFailed("must be an integer from 1 to 64", field="num_samples")
    if body.get("record_stability_info"):
        raise ValidationFailed("is not offered by artweb's sampler", field="record_stability_info")
    for unsupported in ("target_prompt_logprobs",):
        if body.get(unsupported) is not None:
            raise ValidationFailed("is not offered by artweb's sampler", field=unsupported)
    for zero in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if body.get(zero):
            raise ValidationFailed("is not offered by artweb's sampler (0 only)", field=zero)
    from training.wire.tinker import model_input_tokens

    prompt = model_input_tokens(body.get("prompt"), "prompt")
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and (
        not isinstance(last_n, int) or isinstance(last_n, bool) or not 1 <= last_n <= len(prompt) - 1
    ):
        raise ValidationFailed(f"must be from 1 to the prompt's length less one ({len(prompt) - 1})",
                               field="prompt_logprobs_last_n")  # fmt: skip
    _check_sample_size(sampler.base_model, prompt, body.get("sampling_params"))
    payload = {**body, "sampler": sampler.pk}
    future = services.tinker_future_submit(team=access.team, kind="sample", payload=payload)
    return _future_reply(future, sample_sequence_ids=[f"{future.pk}:{i}" for i in range(num)])


def _vocabulary(base: BaseModel) -> int | None:
    """The base model's vocabulary size from its config.json, None where this host cannot read it
    (then the trainer service's own check is the one that refuses)."""
    from training.model_files import base_model_config

    try:
        config = base_model_config(base.source, settings.MODEL_CACHE_DIR) or {}
    except Exception:  # noqa: BLE001 (unreadable here: the trainer service checks it)
        return None
    vocabulary = config.get("vocab_size")
    return (
        vocabulary
        if isinstance(vocabulary, int) and not isinstance(vocabulary, bool) and vocabulary > 0
        else None
    )


def _check_sample_size(base: BaseModel, prompt: list[int], params: Any) -> None:
    """A sample the shared trainer will run (issue 51), refused here before it is queued:
    ``max_tokens`` up to ``INFERENCE_MAX_TOKENS`` (the inference server's cap), the prompt plus it
    within the model's context, every prompt id in its vocabulary. The trainer service checks the
    same for every caller (training.session); a model this host cannot read is checked there only."""
    from training.model_files import context_length

    if params is not None and not isinstance(params, dict):
        raise ValidationFailed("must be an object", field="sampling_params")
    max_tokens = (params or {}).get("max_tokens")
    limit = settings.INFERENCE_MAX_TOKENS
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= limit
    ):
        raise ValidationFailed(f"must be an integer from 1 to {limit} (INFERENCE_MAX_TOKENS)",
                               field="sampling_params.max_tokens")  # fmt: skip
    new_tokens = max_tokens or 64  # projects.jobs.tinker's default
    try:
        context = context_length(base.source, settings.MODEL_CACHE_DIR)
    except Exception:  # noqa: BLE001 (unreadable here: the trainer service checks it)
        context = None
    if context is not None and len(prompt) + new_tokens > context:
        raise ValidationFailed(
            f"the prompt's {len(prompt)} tokens plus max_tokens {new_tokens} exceed {base.name}'s context "
            f"of {context} tokens",
            field="sampling_params.max_tokens",
        )
    vocabulary = _vocabulary(base)
    if vocabulary is not None:
        for position, token in enumerate(prompt):
            if token >= vocabulary:
                raise ValidationFailed(
                    f"token id {token} at position {position} is outside {base.name}'s vocabulary of {vocabulary}",
                    field="prompt",
                )


# ---------------------------------------------------------------------- futures
@endpoint("POST", write=True)
def cancel_future(request: HttpRequest, access: TeamAccess) -> dict[str, Any]:
    """The SDK abandoned a sample (a timeout, a cancelled task): queued, it never runs; running, its
    result is dropped. A finished one stays as it was. Only the team's read-write keys cancel."""
    request_id = _json(request).get("request_id")
    future = selectors.tinker_future_get(team=access.team, request_id=request_id)
    if future is None:
        raise NotFound(f"no request {request_id!r}", field="request_id")
    services.tinker_future_cancel(future=future)
    return {}


@endpoint("POST")
def retrieve_future(request: HttpRequest, access: TeamAccess) -> HttpResponse:
    request_id = _json(request).get("request_id")
    future = selectors.tinker_future_get(team=access.team, request_id=request_id)
    if future is None:
        raise NotFound(f"no request {request_id!r}", field="request_id")
    deadline = time.monotonic() + settings.TINKER_POLL_S
    pause = 0.02
    while future.status == TinkerFutureStatus.PENDING and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 1.5, 0.25)
        selectors.tinker_future_refresh(future=future)
    if future.status == TinkerFutureStatus.PENDING:
        return JsonResponse({"type": "try_again", "request_id": future.pk, "queue_state": "active"})
    if future.status in (TinkerFutureStatus.FAILED, TinkerFutureStatus.CANCELLED):
        return JsonResponse({"error": future.error, "category": future.category or "unknown"})
    if future.blob is not None:
        return HttpResponse(bytes(future.blob), content_type=PROTOBUF)
    return JsonResponse(future.result or {})
