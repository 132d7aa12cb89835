"""POST one chat completion to an OpenAI-compatible endpoint: the single HTTP path shared by the
judge graders (``training.rewards.judge.JudgeClient``) and remote policies
(``training.rollouts.remote.ChatEndpoint``), both ``ChatCompletionsEndpoint`` subclasses. Standard library
only (urllib); no Django.

Safety: every request goes through the endpoint's ``training.safety.outbound.OutboundPolicy`` (public
addresses only unless the operator allow-lists a host; the connection goes to the checked address);
the API key goes only to ``base_url``; redirects are refused (urllib would forward the
Authorization header to wherever Location points and turn the POST into a GET). Error messages
never include the key, the headers or the URL, and an upstream error body is summarised (status and
the error object's message, redacted and cut short), never echoed. A response is read up to 4 MiB.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar

from training.safety.outbound import PUBLIC_ONLY, OutboundPolicy, OutboundRefused, upstream_reason

# Statuses worth a retry: rate limits and server-side trouble; a 4xx is our request's fault.
RETRY_STATUSES = (408, 409, 429, 500, 502, 503, 504)
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
ERROR_BODY_BYTES = 8192  # enough of an error body to find its message
# Some providers' front ends reject urllib's default "Python-urllib/3.x" agent.
USER_AGENT = "artweb"


class ChatCompletionError(RuntimeError):
    """The endpoint failed, or answered with something that is not JSON. The message is meant for
    people and holds no secret. ``timed_out``: the last attempt got no answer in time; ``not_json``:
    the endpoint answered 2xx with a body that is not JSON."""

    def __init__(self, message: str, *, timed_out: bool = False, not_json: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
        self.not_json = not_json


@dataclass(frozen=True)
class ChatCompletionsEndpoint:
    """An OpenAI-compatible endpoint: where to POST, with which key, how patiently. ``base_url``
    ends before ``/chat/completions`` (``https://api.openai.com/v1``, ``http://127.0.0.1:8000/v1``)."""

    base_url: str
    api_key: str = field(default="", repr=False)
    timeout: float = 60.0  # seconds per HTTP request
    retries: int = 1  # extra attempts after a timeout, a connection error, or a RETRY_STATUSES answer
    retry_backoff: float = 0.5  # seconds before the first retry, doubled each time
    outbound: OutboundPolicy = field(default=PUBLIC_ONLY, repr=False)  # which hosts it may reach
    label: ClassVar[str] = "endpoint"  # how error messages name it

    def post(self, body: dict[str, Any]) -> Any:
        """The decoded JSON reply to ``body``; ChatCompletionError (holding no secret) on failure."""
        return post_chat_completion(
            self.base_url,
            body,
            api_key=self.api_key,
            timeout=self.timeout,
            retries=self.retries,
            retry_backoff=self.retry_backoff,
            label=self.label,
            outbound=self.outbound,
        )


def first_choice(payload: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    """A decoded chat completion's ``choices[0]``, its ``message`` and the message's text content
    ("" for none); ValueError saying what is missing when the payload is not a chat completion."""
    try:
        choice = payload["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise ValueError(str(error)) from None
    if not isinstance(content, str):
        raise ValueError("content is not a string")
    return choice, message, content


def post_chat_completion(
    base_url: str,
    body: dict[str, Any],
    *,
    api_key: str = "",
    timeout: float = 60.0,
    retries: int = 1,
    retry_backoff: float = 0.5,
    label: str = "endpoint",
    outbound: OutboundPolicy = PUBLIC_ONLY,
) -> Any:
    """POST ``body`` to ``{base_url}/chat/completions`` and return the decoded JSON payload
    (``post_json`` with the API key as a bearer token)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/chat/completions"
    return post_json(
        url, body, headers=headers, timeout=timeout, retries=retries, retry_backoff=retry_backoff,
        label=label, outbound=outbound,
    )  # fmt: skip


def post_json(
    url: str,
    body: Any,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    retries: int = 1,
    retry_backoff: float = 0.5,
    label: str = "endpoint",
    outbound: OutboundPolicy = PUBLIC_ONLY,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    accept_text: bool = False,
    retry_timeouts: bool = True,
) -> Any:
    """POST ``body`` as JSON to ``url`` with ``headers`` (secrets: never in a message) and return
    the decoded JSON reply. Shared by the chat-completions callers and the endpoint grader
    (``training.rewards.endpoint``).

    A timeout, a connection error or a status in RETRY_STATUSES is retried ``retries`` more times,
    after ``retry_backoff`` seconds, doubled each time (a timeout only with ``retry_timeouts``: a
    caller whose own deadline is the timeout has moved on). Any other failure is final, a host the
    ``outbound`` policy refuses included. Every failure raises ChatCompletionError whose message
    starts with ``label`` ("judge endpoint", "endpoint")."""
    data = json.dumps(body).encode()
    # Both named so the error reports' filter (artweb.error_reports) masks them in a traceback's frames.
    secret_values = tuple(_header_secrets(headers or {}))
    headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": USER_AGENT,
               **(headers or {})}  # fmt: skip
    attempt = 0
    while True:
        try:
            return _post_once(
                url, data, headers, timeout=timeout, label=label, outbound=outbound, secret_values=secret_values,
                max_response_bytes=max_response_bytes, accept_text=accept_text,
            )  # fmt: skip
        except _Retryable as error:
            if attempt >= retries or (error.timed_out and not retry_timeouts):
                raise ChatCompletionError(str(error), timed_out=error.timed_out) from None
            time.sleep(retry_backoff * (2**attempt))
            attempt += 1


def _header_secrets(headers: dict[str, str]) -> list[str]:
    # Any header value may be a credential; a bearer token is also redacted without its scheme word.
    values = [value for value in headers.values() if value]
    return values + [value.split(" ", 1)[1] for value in values if " " in value.strip()]


def _post_once(
    url: str,
    data: bytes,
    headers: dict[str, str],
    *,
    timeout: float,
    label: str,
    outbound: OutboundPolicy,
    secret_values: tuple[str, ...],
    max_response_bytes: int,
    accept_text: bool = False,
) -> Any:
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        outbound.check_url(url, resolve=False)  # the scheme and the name; addresses at connect
        with outbound.opener().open(request, timeout=timeout) as response:
            raw = response.read(max_response_bytes + 1)
    except OutboundRefused as error:
        raise ChatCompletionError(f"{label} refused by the outbound policy: {error}") from None
    except urllib.error.HTTPError as error:  # any status outside 2xx, a refused redirect included
        said = upstream_reason(error.read(ERROR_BODY_BYTES), secrets=secret_values)
        message = f"{label} answered HTTP {error.code}: {said or _phrase(error.code)}"
        if error.code in RETRY_STATUSES:
            raise _Retryable(message) from None
        raise ChatCompletionError(message) from None
    except TimeoutError:  # socket.timeout is an alias since 3.10
        raise _Retryable(f"{label} did not answer within {timeout:g} s", timed_out=True) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(reason, TimeoutError):  # a connect that timed out arrives wrapped
            raise _Retryable(f"{label} did not answer within {timeout:g} s", timed_out=True) from None
        raise _Retryable(f"{label} unreachable: {reason}") from None
    except http.client.HTTPException as error:  # a reply cut short or garbled: not an OSError
        raise _Retryable(f"{label} unreachable: {type(error).__name__}") from None
    except ValueError as error:  # e.g. UnicodeEncodeError: a header http.client cannot write in Latin-1
        raise ChatCompletionError(f"{label} request could not be sent ({type(error).__name__})") from None
    if len(raw) > max_response_bytes:
        raise ChatCompletionError(f"{label} response larger than {_size(max_response_bytes)}")
    try:
        return json.loads(raw)
    except ValueError:  # the body is not shown: an unknown server's answer is never echoed
        if accept_text:  # unless the caller reads text replies (an http_tools tool endpoint's)
            return raw.decode("utf-8", "replace")
        raise ChatCompletionError(f"{label} response is not JSON ({len(raw)} bytes)", not_json=True) from None


def _size(count: int) -> str:
    return f"{count // (1024 * 1024)} MiB" if count % (1024 * 1024) == 0 else f"{count // 1024} KiB"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "no reason given"


class _Retryable(Exception):
    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out
