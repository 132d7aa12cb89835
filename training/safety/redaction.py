"""Secret-free text from what an upstream server said: ``redact`` (keys, tokens, URL userinfo)
and ``upstream_reason`` (a short reason from an error body, never an unknown body echoed). Used by
the outbound policy's callers (training.safety.outbound re-exports both)."""

from __future__ import annotations

import re
from typing import Any

REASON_CHARS = 200
REDACTED = "[redacted]"
_SECRET_PATTERNS = [
    re.compile(r"(?i)\bbearer\s+[^\s\"',;]+"),
    re.compile(r"\b(?:sk|pk|rk|aw)[-_][A-Za-z0-9_\-*]{6,}"),  # OpenAI-style keys, masked ones too
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    re.compile(
        r"(?i)\b(api[_-]?key|token|secret|password|passwd|authorization)(\"?\s*[:=]\s*\"?)[^\s\"',;&]+"
    ),
    re.compile(r"(?<=://)[^/\s@:]+:[^/\s@]+(?=@)"),  # URL userinfo
    re.compile(r"[A-Za-z0-9_\-+/=]{32,}"),  # anything long and token-like
]


def redact(text: str, *, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with the given secrets and anything that looks like a key replaced by [redacted]."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    for pattern in _SECRET_PATTERNS:
        if pattern.groups >= 2:
            text = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
        else:
            text = pattern.sub(REDACTED, text)
    return text


def upstream_reason(body: bytes, *, secrets: tuple[str, ...] = ()) -> str:
    """A short, secret-free reason from an upstream error body: the message of a JSON error object
    (OpenAI's ``{"error": {"message"}}``, or ``message`` / ``detail`` / ``error`` strings), one line,
    redacted, at most REASON_CHARS. Anything else (an HTML page, a banner, plain text) gives "":
    a body from an unknown server is never echoed."""
    import json

    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return ""
    message: Any = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict):
            message = error.get("message")
        elif isinstance(error, str):
            message = error
        if not isinstance(message, str):
            message = next(
                (payload[k] for k in ("message", "detail") if isinstance(payload.get(k), str)), None
            )
    if not isinstance(message, str):
        return ""
    text = redact(" ".join(message.split()), secrets=secrets)
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"
