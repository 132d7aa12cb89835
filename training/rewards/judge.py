"""A minimal client for OpenAI-compatible chat completions, used by the judge graders (`score_model`,
`label_model`, `ruler`). The HTTP call (retries, size cap, refused redirects) is
`training.wire.openai_http.ChatCompletionsEndpoint`, shared with remote policies.

The caller builds one from the team's judge settings (base URL, API key, optional model override)
and hands it to `build_grader(..., judge=client)`; graders never read settings or secrets themselves.
Failures become `model_grader_server_error` (a `GradingError`), so a judge outage is error data on
the samples it hits, never a crash. Error details never include the key, the headers or the URL.

A grader may ask for a `response_format` (a JSON schema for the reply). Not every endpoint honours
one, nor says so in words we could match (vLLM names its grammar backend, not the field): a request
with a response_format that gets a 400 or 422 is sent again without it, and when that one succeeds
the client remembers the model as plain-text-only. So the graders work with any endpoint and get
constrained replies where the endpoint can give them (artweb's own gateway can: constrained
decoding on the CPU server, vLLM's on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from training.rewards.errors import GradingError
from training.wire.openai_http import ChatCompletionError, ChatCompletionsEndpoint, first_choice

SERVER_ERROR = "model_grader_server_error"


@dataclass(frozen=True)
class JudgeReply:
    content: str
    refusal: str | None
    finish_reason: str | None
    sampled_model_name: str
    token_usage: dict[str, dict[str, int]]  # {model: {prompt_tokens, completion_tokens, total_tokens}}


@dataclass(frozen=True)
class JudgeClient(ChatCompletionsEndpoint):
    """The team's judge endpoint (base_url, api_key, timeout, retries, retry_backoff:
    ``training.wire.openai_http.ChatCompletionsEndpoint``), optionally pinned to one model."""

    model: str | None = None  # when set, replaces every spec's `model` (an endpoint with one model)
    max_concurrency: int = 4  # judge calls in flight at once when grading a batch
    # Models this endpoint refused a response_format for (see the module doc); grows, never shrinks.
    plain_text_models: set[str] = field(default_factory=set, repr=False, compare=False)
    label: ClassVar[str] = "judge endpoint"

    def resolve_model(self, spec_model: str) -> str:
        return self.model or spec_model

    def complete(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        sampling_params: dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None,
    ) -> JudgeReply:
        """One chat completion; raises GradingError(model_grader_server_error) on any failure.
        `response_format` is sent where the endpoint takes it (see the module doc)."""
        body = {"model": self.resolve_model(model), "messages": messages, **request_params(sampling_params)}
        refused = False
        if response_format is not None and body["model"] not in self.plain_text_models:
            try:
                return parse_reply(self.post({**body, "response_format": response_format}), body["model"])
            except ChatCompletionError as error:
                if not _bad_request(str(error)):
                    raise GradingError(SERVER_ERROR, str(error)) from None
                refused = True
        try:
            payload = self.post(body)
        except ChatCompletionError as error:
            raise GradingError(SERVER_ERROR, str(error)) from None
        if refused:  # the plain request went through: it was the response_format
            self.plain_text_models.add(body["model"])
        return parse_reply(payload, body["model"])


def _bad_request(message: str) -> bool:
    """Whether a ChatCompletionError's message (openai_http's wording) is a 400 or 422 answer."""
    return any(f"answered HTTP {status}:" in message for status in (400, 422))


# OpenAI's grader `sampling_params` names → chat completions request fields. OpenAI spells the
# token cap `max_completions_tokens` in grader specs; `max_tokens` is kept for servers (older vLLM,
# llama.cpp) that know only that one.
SAMPLING_PARAMS: dict[str, tuple[str, str]] = {
    "temperature": ("number", "temperature"),
    "top_p": ("number", "top_p"),
    "seed": ("integer", "seed"),
    "max_completions_tokens": ("positive_integer", "max_completion_tokens"),
    "max_completion_tokens": ("positive_integer", "max_completion_tokens"),
    "max_tokens": ("positive_integer", "max_tokens"),
    "reasoning_effort": ("string", "reasoning_effort"),
}


def request_params(sampling_params: dict[str, Any] | None) -> dict[str, Any]:
    return {SAMPLING_PARAMS[key][1]: value for key, value in (sampling_params or {}).items()}


def sampling_params_problems(value: dict[str, Any], path: str) -> list[dict[str, str]]:
    problems = []
    for key, setting in value.items():
        if key not in SAMPLING_PARAMS:
            allowed = ", ".join(SAMPLING_PARAMS)
            problems.append(
                {"path": f"{path}.{key}", "message": f"unknown sampling parameter (use {allowed})"}
            )
            continue
        kind = SAMPLING_PARAMS[key][0]
        is_int = isinstance(setting, int) and not isinstance(setting, bool)
        ok = {
            "number": isinstance(setting, int | float) and not isinstance(setting, bool),
            "integer": is_int,
            "positive_integer": is_int and setting > 0,
            "string": isinstance(setting, str),
        }[kind]
        if not ok:
            problems.append({"path": f"{path}.{key}", "message": f"must be {kind.replace('_', ' ')}"})
    return problems


def parse_reply(payload: Any, requested_model: str) -> JudgeReply:
    try:
        choice, message, content = first_choice(payload)
    except ValueError as error:
        raise GradingError(
            SERVER_ERROR, f"judge response has no choices[0].message.content ({error})"
        ) from None
    model = payload.get("model") or requested_model
    usage = payload.get("usage") or {}
    token_usage = {}
    if isinstance(usage, dict):
        counts = {
            key: int(usage[key])
            for key in ("prompt_tokens", "completion_tokens", "total_tokens")
            if isinstance(usage.get(key), int)
        }
        if counts:
            counts.setdefault(
                "total_tokens", counts.get("prompt_tokens", 0) + counts.get("completion_tokens", 0)
            )
            token_usage = {model: counts}
    refusal = message.get("refusal")
    return JudgeReply(
        content=content,
        refusal=refusal if isinstance(refusal, str) and refusal else None,
        finish_reason=choice.get("finish_reason"),
        sampled_model_name=model,
        token_usage=token_usage,
    )


def merge_usage(*usages: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    merged: dict[str, dict[str, int]] = {}
    for usage in usages:
        for model, counts in usage.items():
            target = merged.setdefault(model, {})
            for key, count in counts.items():
                target[key] = target.get(key, 0) + count
    return merged
