"""Streams of the chat completions protocol (training.serving.protocol): the
``chat.completion.chunk`` deltas of a streamed completion and their server-sent events.
Nothing here imports torch or Django."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from training.engines.base import Choice, TokenDelta
from training.serving.protocol import ChatRequest
from training.serving.responses import logprobs_content, render_choice


@dataclass
class ChunkContext:
    request: ChatRequest
    completion_id: str
    created: int
    model: str

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.request.include_usage:
            body["usage"] = None
        body.update(extra)
        return body


def first_chunks(context: ChunkContext) -> Iterator[dict[str, Any]]:
    """Sent as soon as the request is accepted, before anything is sampled: the role of each choice."""
    for index in range(context.request.n):
        delta = {"role": "assistant", "content": ""}
        yield context.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])


def choice_chunks(
    context: ChunkContext,
    index: int,
    choice: Choice,
    *,
    decode: Callable[[list[int]], str],
    token_text: Callable[[int], str],
) -> Iterator[dict[str, Any]]:
    """The chunks of one sampled choice: a content delta per token (with its logprob and id), or,
    when the model called tools, the content and the calls in one delta each; then the finish."""
    request = context.request
    rendered = render_choice(request, choice)

    def entry(
        delta: dict[str, Any],
        ids: list[int],
        logprobs: list[float],
        top: list[list[tuple[int, float]]] | None,
    ) -> dict[str, Any]:
        return _choice_item(request, index, delta, ids, logprobs, top, token_text)

    if rendered.tool_calls:
        delta: dict[str, Any] = {"content": rendered.content} if rendered.content else {}
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(rendered.tool_calls)]
        yield context.chunk(
            [entry(delta, list(choice.token_ids), list(choice.logprobs), choice.top_logprobs)]
        )
    else:
        text = rendered.content or ""
        pieces = token_pieces(choice.token_ids, text, decode)
        for position, (token_id, logprob, piece) in enumerate(
            zip(choice.token_ids, choice.logprobs, pieces, strict=True)
        ):
            top = [choice.top_logprobs[position]] if choice.top_logprobs else None
            yield context.chunk([entry({"content": piece}, [token_id], [logprob], top)])
        if not choice.token_ids and text:
            yield context.chunk([entry({"content": text}, [], [], None)])
    yield finish_chunk(context, index, rendered.finish_reason)


def token_chunk(context: ChunkContext, delta: TokenDelta, token_text: Callable[[int], str]) -> dict[str, Any]:
    """The chunk of one token sampled while the batch is still running (TokenDelta, which holds
    back split characters and possible stop strings): its text, logprob and id."""
    top = [delta.top_logprobs] if delta.top_logprobs else None
    item = _choice_item(context.request, delta.index, {"content": delta.text}, [delta.token_id],
                        [delta.logprob], top, token_text)  # fmt: skip
    return context.chunk([item])


def finish_chunk(context: ChunkContext, index: int, finish_reason: str) -> dict[str, Any]:
    return context.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])


def _choice_item(
    request: ChatRequest,
    index: int,
    delta: dict[str, Any],
    ids: list[int],
    logprobs: list[float],
    top: Sequence[Sequence[tuple[int, float]]] | None,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    item: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    if request.logprobs:
        item["logprobs"] = {
            "content": logprobs_content(request, ids, logprobs, token_text, top),
            "refusal": None,
        }
    if request.return_token_ids:
        item["token_ids"] = ids
    return item


def token_pieces(token_ids: Sequence[int], text: str, decode: Callable[[list[int]], str]) -> list[str]:
    """The part of `text` each token adds, so the pieces join to exactly `text` (which may be cut
    before a stop string). A token that ends inside a multi-byte character adds nothing; the next
    one adds the whole character."""
    pieces, emitted = [], 0
    for end in range(1, len(token_ids) + 1):
        prefix = decode(list(token_ids[:end]))
        if prefix.endswith("\ufffd") and end < len(token_ids):
            pieces.append("")
            continue
        upto = max(emitted, min(len(prefix), len(text)))
        pieces.append(text[emitted:upto])
        emitted = upto
    if pieces:
        pieces[-1] += text[emitted:]
    return pieces


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
