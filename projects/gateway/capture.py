"""Stored completions at the gateway (OpenAI's ``store: true``; projects.models.completions).

Whether a completion is stored is the team's choice (``Team.completion_storage``): ``off`` (the
default) stores nothing and answers a ``store: true`` with a 400 naming ``store``; ``requested``
stores those sent with ``store: true``; ``all`` every one not sent with ``store: false``. An owner
can set it per model (``Team.completion_storage_models``) and per API key
(``ApiKey.completion_storage``): the key's setting wins, then the model's, then the team's. A stored completion's ``metadata``
is checked as OpenAI does (at most 16 pairs, keys up to 64 characters, string values up to 512);
a completion that is not stored is served whatever metadata it carries, as vLLM serves it.

A stored completion is asked of the inference server with ``logprobs`` and ``return_token_ids``
whether or not the client asked (training needs the exact tokens and the sampler's logprobs), and
the client is answered as if it had not: the fields it did not ask for are taken out of the reply,
or out of each stream event as it passes. A stream is joined into one completion as it is relayed
(content, tool calls, finish reasons, ids and logprobs per choice) and stored when it ends, a
stream the client left early included (its unfinished choices have no finish reason). Rows are
written on the gateway's database threads after the response has gone (as usage is), so capture
adds no database round trip to a reply.

A row is bounded (``STORED_COMPLETION_MAX_BYTES``): one over it loses its logprobs (``bounded``);
one still over it is not stored, and a warning says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.http import HttpResponse, JsonResponse

from projects.gateway.errors import GatewayError
from projects.models import ApiKey, CompletionStorage, Team

log = logging.getLogger(__name__)

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
TOKEN_FIELDS = ("token_ids", "prompt_token_ids")


@dataclass(frozen=True)
class StoreFields:
    """``store`` and ``metadata`` as the client sent them (None: ``store`` not sent)."""

    store: bool | None
    metadata: dict[str, Any]  # the object sent ({} when none, or not an object)
    raw_metadata: Any = None  # exactly as sent, checked when the completion is stored


def store_fields(body: dict[str, Any]) -> StoreFields:
    """The body's ``store`` (checked: GatewayError 400) and ``metadata`` as sent: checked only
    when the completion is stored (``capture_for``), so a client that sends metadata of its own
    shape to a server that ignores it (vLLM's) is served here as there."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise GatewayError(400, "store must be true or false", param="store", code="invalid_type")
    metadata = body.get("metadata")
    return StoreFields(store, metadata if isinstance(metadata, dict) else {}, metadata)


def conversation_of(fields: StoreFields, key: str) -> str | None:
    """The request's conversation: its metadata's string value under the team's key."""
    value = fields.metadata.get(key)
    return value if isinstance(value, str) and value else None


def checked_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """OpenAI's metadata rules; GatewayError 400 naming ``metadata`` with the reason."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise GatewayError(
            400,
            f"metadata may have at most {MAX_METADATA_PAIRS} pairs",
            param="metadata",
            code="invalid_value",
        )
    for key, value in metadata.items():
        if not 1 <= len(key) <= MAX_METADATA_KEY or "\x00" in key:
            raise GatewayError(
                400,
                f"metadata keys must be 1 to {MAX_METADATA_KEY} characters: {key[:80]!r}",
                param="metadata",
                code="invalid_value",
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE or "\x00" in value:
            raise GatewayError(
                400, f"metadata[{key!r}] must be a string of at most {MAX_METADATA_VALUE} characters",
                param="metadata", code="invalid_value",
            )  # fmt: skip
    return dict(metadata)


@dataclass
class Capture:
    """A completion being stored: what the client asked for, and what the reply brought."""

    team_id: int
    metadata: dict[str, str]
    conversation_id: str
    client_logprobs: bool  # the client asked for logprobs (so it sees them)
    client_token_ids: bool  # the client asked for return_token_ids
    client_request: dict[str, Any]  # the body as sent, less model, store and metadata
    started: float = field(default_factory=time.monotonic)


def storage_mode(team: Team, model_id: str, api_key: ApiKey | None = None) -> tuple[str, str]:
    """Which of a request's completions are stored, and whose setting says so: the key's own
    (``ApiKey.completion_storage``), else the team's for the model the request names (any of its
    checkpoints or aliases: ``Team.completion_storage_models``), else the team's."""
    if api_key is not None and api_key.completion_storage:
        return api_key.completion_storage, f"API key {api_key.prefix}"
    name = model_id.partition(":")[0]
    mode = (team.completion_storage_models or {}).get(name)
    if mode:
        return mode, f"model {name}"
    return team.completion_storage, "team"


def capture_for(
    team: Team, fields: StoreFields, decoded: dict[str, Any], api_key: ApiKey | None = None
) -> Capture | None:
    """The capture of a request of ``team``'s (None: not stored); 400 when the client asked
    to store and the setting that applies (``storage_mode``) stores nothing."""
    mode, whose = storage_mode(team, str(decoded.get("model") or ""), api_key)
    if fields.store is True and mode == CompletionStorage.OFF:
        raise GatewayError(
            400, f"Completions are not stored here (the {whose} setting is off): an owner turns storage on "
            "(PATCH /api/v1/team with completion_storage 'requested' or 'all', per model with "
            "completion_storage_models, or per key at /api/v1/api-keys).",
            param="store", code="store_not_enabled",
        )  # fmt: skip
    if not (fields.store is True or (mode == CompletionStorage.ALL and fields.store is not False)):
        return None
    if fields.raw_metadata is not None and not isinstance(fields.raw_metadata, dict):
        raise GatewayError(
            400, "metadata must be an object of strings", param="metadata", code="invalid_type"
        )
    metadata = checked_metadata(fields.metadata)
    return Capture(
        team_id=team.pk,
        metadata=metadata,
        conversation_id=metadata.get(team.conversation_key, ""),
        client_logprobs=decoded.get("logprobs") is True,
        client_token_ids=decoded.get("return_token_ids") is True,
        client_request={k: v for k, v in decoded.items() if k not in ("model", "store", "metadata")},
    )


def upstream_body(decoded: dict[str, Any]) -> dict[str, Any]:
    """The body the inference server is sent for a stored completion: with logprobs and ids."""
    return {**decoded, "logprobs": True, "return_token_ids": True}


# ---------------------------------------------------------------- the client's view


def client_choice(choice: dict[str, Any], capture: Capture) -> None:
    """Take out of ``choice`` (a reply's or a stream event's) what the client did not ask for."""
    if not capture.client_logprobs:
        choice["logprobs"] = None
    if not capture.client_token_ids:
        choice.pop("token_ids", None)


def client_view(body: dict[str, Any], capture: Capture) -> dict[str, Any]:
    view = dict(body)
    if not capture.client_token_ids:
        view.pop("prompt_token_ids", None)
    view["choices"] = [dict(choice) for choice in body.get("choices") or [] if isinstance(choice, dict)]
    for choice in view["choices"]:
        client_choice(choice, capture)
    return view


# ---------------------------------------------------------------- records


@dataclass
class Record:
    """A stored completion's row, ready to write (projects.services.completions)."""

    team_id: int
    completion_id: str
    api_key_id: int | None
    model: str
    served_by: str
    checkpoint_id: int | None
    stream: bool
    metadata: dict[str, str]
    conversation_id: str
    request: dict[str, Any]
    response: dict[str, Any]
    prompt_token_ids: list[int] | None
    token_ids: list[list[int] | None] | None
    logprobs: list[list[float] | None] | None
    latency_ms: int
    bounded: bool = False


def _sampled_logprobs(choice: dict[str, Any]) -> list[float] | None:
    content = (
        (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    )
    if not isinstance(content, list):
        return None
    return [float(entry["logprob"]) for entry in content if isinstance(entry, dict) and "logprob" in entry]


def record_of(
    full: dict[str, Any], view: dict[str, Any], capture: Capture, *, route: Any, stream: bool
) -> Record | None:
    """The row of a completion: ``full`` as the server answered it (ids and logprobs), ``view``
    as the client saw it. None (and a warning) when it cannot be stored within the bound."""
    choices = [c for c in full.get("choices") or [] if isinstance(c, dict)]
    token_ids = [c.get("token_ids") if isinstance(c.get("token_ids"), list) else None for c in choices]
    prompt = full.get("prompt_token_ids")
    if prompt is None:  # annotated per choice (projects.gateway.token_ids) or absent
        prompt = next((c.get("prompt_token_ids") for c in choices if c.get("prompt_token_ids")), None)
    target = route.target
    record = Record(
        team_id=capture.team_id,
        completion_id=str(full.get("id") or ""),
        api_key_id=route.api_key.pk if route.api_key is not None else None,
        model=route.chat.request.model,
        served_by=target.model_id,
        checkpoint_id=target.checkpoint.pk if target.checkpoint is not None else None,
        stream=stream,
        metadata=capture.metadata,
        conversation_id=capture.conversation_id,
        request=capture.client_request,
        response=view,
        prompt_token_ids=prompt if isinstance(prompt, list) else None,
        token_ids=token_ids if any(ids is not None for ids in token_ids) else None,
        logprobs=[_sampled_logprobs(c) for c in choices] or None,
        latency_ms=int((time.monotonic() - capture.started) * 1000),
    )
    if not record.completion_id:
        log.warning("a stored completion for team %s had no id: not stored", capture.team_id)
        return None
    bound = settings.STORED_COMPLETION_MAX_BYTES
    if _size(record) > bound:
        record.logprobs, record.bounded = None, True
        for choice in record.response.get("choices", []):
            choice["logprobs"] = None
        if _size(record) > bound:
            log.warning(
                "stored completion %s is over STORED_COMPLETION_MAX_BYTES (%d) without its logprobs: not stored",
                record.completion_id, bound,
            )  # fmt: skip
            return None
    return record


def _size(record: Record) -> int:
    parts = (record.request, record.response, record.prompt_token_ids, record.token_ids, record.logprobs)
    return sum(len(json.dumps(part, separators=(",", ":"))) for part in parts)


def stored_reply(
    answer: HttpResponse, route: Any, capture: Capture, keep: Callable[[Record], None]
) -> tuple[HttpResponse, dict[str, Any] | None]:
    """A whole 200 reply: its record is handed to ``keep``; returns the client's response (and
    the full body, which ``projects.gateway.token_ids`` annotates when the client asked)."""
    try:
        full = json.loads(answer.content)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return answer, None
    if not isinstance(full, dict):
        return answer, None
    view = client_view(full, capture)
    record = record_of(full, view, capture, route=route, stream=False)
    if record is not None:
        keep(record)
    if capture.client_logprobs:  # annotated with ids as before (token_ids), from the full body
        return answer, full
    return JsonResponse(view), None


# ---------------------------------------------------------------- streams


class StreamJoin:
    """A stream's events joined into one completion as they pass, and rewritten for the client."""

    def __init__(self, capture: Capture) -> None:
        self.capture = capture
        self.head: dict[str, Any] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, dict[str, Any]] = {}
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        return b"".join(self._event(event) for event in events)

    def rest(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event + b"\n\n"
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        if not isinstance(chunk, dict):
            return event + b"\n\n"
        self._join(chunk)
        if not self.capture.client_token_ids:
            chunk.pop("prompt_token_ids", None)
        for item in chunk.get("choices") or []:
            if isinstance(item, dict):
                client_choice(item, self.capture)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def _join(self, chunk: dict[str, Any]) -> None:
        if not self.head and chunk.get("id"):
            self.head = {key: chunk.get(key) for key in ("id", "created", "model", "system_fingerprint")}
        if isinstance(chunk.get("prompt_token_ids"), list):
            self.prompt_token_ids = chunk["prompt_token_ids"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for item in chunk.get("choices") or []:
            if not isinstance(item, dict) or not isinstance(item.get("index"), int):
                continue
            choice = self.choices.setdefault(
                item["index"],
                {"content": [], "tool_calls": {}, "finish_reason": None, "token_ids": [], "logprobs": []},
            )
            delta = item.get("delta") or {}
            if isinstance(delta.get("content"), str):
                choice["content"].append(delta["content"])
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    joined = choice["tool_calls"].setdefault(
                        call.get("index", 0),
                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    joined["id"] = call.get("id") or joined["id"]
                    function = call.get("function") or {}
                    joined["function"]["name"] += function.get("name") or ""
                    joined["function"]["arguments"] += function.get("arguments") or ""
            if item.get("finish_reason"):
                choice["finish_reason"] = item["finish_reason"]
            if isinstance(item.get("token_ids"), list):
                choice["token_ids"].extend(item["token_ids"])
            content = (
                (item.get("logprobs") or {}).get("content")
                if isinstance(item.get("logprobs"), dict)
                else None
            )
            if isinstance(content, list):
                choice["logprobs"].extend(content)

    def completion(self) -> dict[str, Any]:
        """The stream as one ``chat.completion`` (as the server would have answered it whole)."""
        choices = []
        for index in sorted(self.choices):
            joined = self.choices[index]
            message: dict[str, Any] = {"role": "assistant", "content": "".join(joined["content"]) or None}
            if joined["tool_calls"]:
                message["tool_calls"] = [joined["tool_calls"][k] for k in sorted(joined["tool_calls"])]
            elif message["content"] is None:
                message["content"] = ""
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": joined["finish_reason"],
                "logprobs": {"content": joined["logprobs"]} if joined["logprobs"] else None,
            }
            if joined["token_ids"]:
                choice["token_ids"] = joined["token_ids"]
            choices.append(choice)
        body: dict[str, Any] = {**self.head, "object": "chat.completion", "choices": choices}
        if self.usage is not None:
            body["usage"] = self.usage
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


async def stored_stream(
    chunks: AsyncIterator[bytes], route: Any, capture: Capture, keep: Callable[[Record], None]
) -> AsyncIterator[bytes]:
    """``chunks`` (the relayed stream) rewritten for the client; joined and kept when it ends."""
    join = StreamJoin(capture)
    try:
        async for data in chunks:
            passed = join.feed(data)
            if passed:
                yield passed
        rest = join.rest()
        if rest:
            yield rest
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        if join.head:
            full = join.completion()
            record = record_of(full, client_view(full, capture), capture, route=route, stream=True)
            if record is not None:
                keep(record)


def with_capture(route: Any, capture: Capture | None) -> Any:
    """``route`` whose body asks the server for what a stored completion keeps."""
    if capture is None:
        return route
    chat = route.chat
    decoded = upstream_body(chat.decoded)
    request = dataclasses.replace(chat.request, logprobs=True, return_token_ids=True)
    new_chat = dataclasses.replace(chat, raw=json.dumps(decoded).encode(), decoded=decoded, request=request)
    return dataclasses.replace(route, chat=new_chat, capture=capture)
