"""Typed environment helpers: every setting comes from the environment with a typed default.

A bad value fails loudly at start-up (ImproperlyConfigured) instead of surfacing later as a
confusing runtime error. Secrets may be given as ``<NAME>_FILE`` pointing at a file.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        try:
            return Path(file_path).read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{name}_FILE={file_path!r} cannot be read: {exc}") from exc
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} must be >= {minimum}")
    return value


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from exc


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (case and surrounding spaces ignored); empty means ``default``."""
    raw = os.environ.get(name)
    value = (raw or "").strip().lower() or default
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={raw!r} must be one of {', '.join(choices)}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [part.strip() for part in raw.split(",") if part.strip()]


def load_or_create_secret(path: Path) -> str:
    """Read a secret from ``path``, creating it (mode 0600) with a random value the first time."""
    import secrets

    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    value = secrets.token_urlsafe(50)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value)
    try:
        os.link(tmp, path)  # atomic create-if-absent: a concurrent starter keeps the first key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()
