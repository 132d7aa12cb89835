"""A minimal client for OpenAI-compatible chat completions, used by the judge graders (`score_model`,
`label_model`, `ruler`). Standard library only (urllib).

The caller builds one from the team's judge settings (base URL, API key, optional model override)
and hands it to `build_grader(..., judge=client)`; graders never read settings or secrets themselves.
Failures become `model_grader_server_error` (a `GradingError`), so a judge outage is error data on
the samples it hits, never a crash. Error details never include the key, the headers or the URL.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from training.rewards.errors import GradingError

SERVER_ERROR = "model_grader_server_error"
# Statuses worth a retry: rate limits and server-side trouble; a 4xx is our request's fault.
RETRY_STATUSES = (408, 409, 429, 500, 502, 503, 504)
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
DETAIL_CHARS = 300


@dataclass(frozen=True)
class JudgeReply:
    content: str
    refusal: str | None
    finish_reason: str | None
    sampled_model_name: str
    token_usage: dict[str, dict[str, int]]  # {model: {prompt_tokens, completion_tokens, total_tokens}}


@dataclass(frozen=True)
class JudgeClient:
    """An OpenAI-compatible endpoint. `base_url` ends before `/chat/completions`
    (`https://api.openai.com/v1`, `http://127.0.0.1:8000/v1`)."""

    base_url: str
    api_key: str = field(default="", repr=False)
    model: str | None = None  # when set, replaces every spec's `model` (an endpoint with one model)
    timeout: float = 60.0  # seconds per HTTP request
    max_concurrency: int = 4  # judge calls in flight at once when grading a batch
    retries: int = 1  # extra attempts after a timeout, a connection error, 429 or 5xx
    retry_backoff: float = 0.5  # seconds before the first retry, doubled each time

    def resolve_model(self, spec_model: str) -> str:
        return self.model or spec_model

    def complete(
        self, *, model: str, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None
    ) -> JudgeReply:
        """One chat completion; raises GradingError(model_grader_server_error) on any failure."""
        body = {"model": self.resolve_model(model), "messages": messages, **request_params(sampling_params)}
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url.rstrip("/") + "/chat/completions"
        attempt = 0
        while True:
            try:
                payload = self._post(url, data, headers)
                break
            except _Retryable as error:
                if attempt >= self.retries:
                    raise GradingError(SERVER_ERROR, str(error)) from None
                time.sleep(self.retry_backoff * (2**attempt))
                attempt += 1
        return parse_reply(payload, body["model"])

    def _post(self, url: str, data: bytes, headers: dict[str, str]) -> Any:
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                raw = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as error:
            text = _snippet(error.read(DETAIL_CHARS).decode("utf-8", "replace"))
            message = f"judge endpoint answered HTTP {error.code}: {text}"
            if error.code in RETRY_STATUSES:
                raise _Retryable(message) from None
            raise GradingError(SERVER_ERROR, message) from None
        except TimeoutError:  # socket.timeout is an alias since 3.10
            raise _Retryable(f"judge endpoint did not answer within {self.timeout:g} s") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise _Retryable(f"judge endpoint unreachable: {reason}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise GradingError(SERVER_ERROR, "judge response larger than 4 MiB")
        try:
            return json.loads(raw)
        except ValueError:
            raise GradingError(
                SERVER_ERROR, f"judge response is not JSON: {_snippet(raw.decode('utf-8', 'replace'))}"
            ) from None


class _Retryable(Exception):
    pass


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect would carry the team's API key to wherever the Location header points (urllib
    forwards Authorization) and turn the POST into a GET: treat it as the error it is here."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None


_OPENER = urllib.request.build_opener(_RefuseRedirects())


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
        choice = payload["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise TypeError("content is not a string")
    except (KeyError, IndexError, TypeError, AttributeError) as error:
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


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"
