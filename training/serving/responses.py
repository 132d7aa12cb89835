"""Responses of the chat completions protocol (training.serving.protocol): one sampled choice as
the client sees it (content, or Hermes tool calls parsed out of the text), its logprobs, and a
whole (non-streamed) completion body. Nothing here imports torch or Django."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from training.engines.base import Choice
from training.rollouts.tools import parse_tool_calls
from training.serving.protocol import ChatRequest


@dataclass
class Rendered:
    """One choice as the client sees it: the assistant message and why it ended."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str


def new_completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def render_choice(request: ChatRequest, choice: Choice) -> Rendered:
    """Split the model's text into content and tool calls (Hermes `<tool_call>{json}</tool_call>`).

    A turn whose calls do not all parse stays plain content, as vLLM's Hermes parser does: the
    client sees what the model wrote rather than a half-understood call.
    """
    text = request.tool_prefill() + choice.text
    if request.uses_tools and "<tool_call>" in text:
        calls = parse_tool_calls(text)
        if calls and all(call.error is None for call in calls):
            before = text[: text.index("<tool_call>")].strip()
            return Rendered(
                content=before or None,
                tool_calls=[
                    {
                        "id": f"call_{secrets.token_hex(12)}",
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json},
                    }
                    for call in calls
                ],
                finish_reason="tool_calls",
            )
    return Rendered(content=text, tool_calls=[], finish_reason=choice.finish_reason)


def logprobs_content(
    request: ChatRequest,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    token_text: Callable[[int], str],
    top: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content`; `top` holds the engine's alternatives per token, if any."""
    if request.return_tokens_as_token_ids:  # vLLM's extension: `token_id:<id>` for every token
        token_text = _token_id_text
    entries = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        entry = _logprob_entry(token_text(token_id), logprob)
        alternatives: list[dict[str, Any]] = []
        if request.top_logprobs:
            if top is not None:
                alternatives = [
                    _logprob_entry(token_text(other), other_logprob)
                    for other, other_logprob in top[position][: request.top_logprobs]
                ]
            else:  # the engine reports no alternatives (see the module doc)
                alternatives = [dict(entry)]
        entry["top_logprobs"] = alternatives
        entries.append(entry)
    return entries


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _logprob_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def usage_body(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(choice.token_ids) for choice in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def completion_body(
    request: ChatRequest,
    choices: Sequence[Choice],
    *,
    completion_id: str,
    created: int,
    model: str,
    prompt_token_ids: list[int],
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    rendered_choices = []
    for index, choice in enumerate(choices):
        rendered = render_choice(request, choice)
        message: dict[str, Any] = {"role": "assistant", "content": rendered.content, "refusal": None}
        if rendered.tool_calls:
            message["tool_calls"] = rendered.tool_calls
        item: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": rendered.finish_reason,
        }
        if request.logprobs:
            content = logprobs_content(
                request, choice.token_ids, choice.logprobs, token_text, choice.top_logprobs
            )
            item["logprobs"] = {"content": content, "refusal": None}
        if request.return_token_ids:
            item["token_ids"] = list(choice.token_ids)
        rendered_choices.append(item)
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": rendered_choices,
        "usage": usage_body(len(prompt_token_ids), choices),
        "system_fingerprint": None,
    }
    if request.return_token_ids:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body
