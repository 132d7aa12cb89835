"""Environment settings that the operator or a secret decides, in one place for the services, the
API, the dashboard and the workers: the stdio program allow-list and write-only MCP headers.

Safety invariant: an MCP environment's `config.headers` values (e.g. `Authorization`) are stored
only as Fernet ciphertext (`config.headers_encrypted`, `projects.secrets`), are never rendered
(`config_public` shows `MASK`), and are decrypted only to build the environment (`config_for_build`).
Stored values are sent only to the URL they were entered for: a changed `config.url` needs them
again (`projects.secrets.secret_follows_url`), so nobody who can edit but not read an environment
can redirect them elsewhere.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.views.decorators.debug import sensitive_variables

from projects import secrets
from projects.errors import ValidationFailed
from training.environments import StdioPolicy
from training.safety.slots import SlotPolicy

MASK = secrets.MASK
ENCRYPTED_HEADERS = "headers_encrypted"


def mcp_allowed_programs() -> tuple[str, ...]:
    """Commands an MCP stdio config may run besides the shipped demo server, each matched whole:
    the operator's `MCP_STDIO_PROGRAMS` setting."""
    return tuple(settings.MCP_STDIO_PROGRAMS)


def sandbox_slots(*, interactive: bool = False) -> SlotPolicy:
    """The host's sandbox caps; a web request (`interactive`) waits briefly for a slot, a worker long."""
    return SlotPolicy(
        directory=str(settings.SANDBOX_SLOT_DIR),
        total=settings.SANDBOX_MAX_TOTAL,
        per_team=settings.SANDBOX_MAX_PER_TEAM,
        wait_seconds=settings.SANDBOX_WEB_WAIT_S if interactive else settings.SANDBOX_WAIT_S,
    )


def mcp_stdio_policy(*, team_id: Any = None, interactive: bool = False) -> StdioPolicy:
    """The operator's rules for MCP stdio servers; `team_id` names whose sandbox slot one takes."""
    return StdioPolicy(
        commands=mcp_allowed_programs(),
        env_names=tuple(settings.MCP_STDIO_ENV),
        network=settings.MCP_STDIO_NETWORK,
        memory_bytes=settings.MCP_STDIO_MEMORY_MB * 1024 * 1024,
        allow_unsandboxed=settings.GRADER_SANDBOX_ALLOW_UNSANDBOXED,
        slots=sandbox_slots(interactive=interactive),
        team=str(team_id or ""),
    )


def config_public(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the API and the dashboard show it: header names with `MASK` for their values."""
    shown = {key: value for key, value in config.items() if key not in ("headers", ENCRYPTED_HEADERS)}
    if isinstance(shown.get("url"), str):
        shown["url"] = secrets.url_public(shown["url"])  # a credential stored before input refused it
    names = list(config.get(ENCRYPTED_HEADERS) or {}) + list(config.get("headers") or {})
    if names:
        shown["headers"] = {name: MASK for name in names}
    return shown


@sensitive_variables("plain")  # decrypted header values
def config_for_build(config: dict[str, Any]) -> dict[str, Any]:
    """The config with plaintext headers, for the worker that connects to the server.
    Raises ValueError when a stored value cannot be decrypted (SECRET_KEY changed)."""
    if ENCRYPTED_HEADERS not in config:
        return dict(config)
    plain = {key: value for key, value in config.items() if key != ENCRYPTED_HEADERS}
    plain["headers"] = _decrypted(config)
    return plain


def config_with_kept_headers(config: Any, *, stored: dict[str, Any]) -> Any:
    """The config a write asked for, with the stored header values put back where it keeps them:
    a value equal to `MASK` keeps that header's stored value, and a config without `headers` keeps
    all of them; both only while `config.url` is the stored one. Other values replace the stored
    ones, and a header left out of a given `headers` object is removed. Anything malformed is left
    for the registry's validation to name."""
    if not isinstance(config, dict) or "url" not in config:
        return config
    headers = config.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return config
    stored_names = list(stored.get(ENCRYPTED_HEADERS) or {}) + list(stored.get("headers") or {})
    masked = [name for name, value in (headers or {}).items() if value == MASK]
    if not masked and (headers is not None or not stored_names):
        return config
    same_url = stored_names and config["url"] == stored.get("url")
    if not same_url:
        secrets.secret_follows_url(
            stored_url=stored.get("url") or "",
            url=config["url"],
            has_stored_secret=bool(stored_names),
            secret_given=headers is not None,
            url_field="config.url",
            secret_field="config.headers",
            empty="{}",
        )
        raise ValidationFailed(
            "give the value: there is no stored value for this URL to keep",
            field=f"config.headers.{masked[0]}",
        )
    kept = _stored_headers(stored)
    if headers is None:
        return {**config, "headers": kept}
    for name in masked:
        if name not in kept:
            raise ValidationFailed(
                "give the value: no value is stored for this header", field=f"config.headers.{name}"
            )
    return {
        **config,
        "headers": {name: kept[name] if value == MASK else value for name, value in headers.items()},
    }


def config_for_storage(config: dict[str, Any]) -> dict[str, Any]:
    """A validated config as stored: header values encrypted, under `headers_encrypted`."""
    headers = config.get("headers")
    if not headers:
        return {key: value for key, value in config.items() if key != "headers"}
    stored = {key: value for key, value in config.items() if key != "headers"}
    stored[ENCRYPTED_HEADERS] = {name: secrets.encrypt(value) for name, value in headers.items()}
    return stored


@sensitive_variables()
def _stored_headers(stored: dict[str, Any]) -> dict[str, str]:
    try:
        return {**(stored.get("headers") or {}), **_decrypted(stored)}
    except ValueError as exc:
        raise ValidationFailed(f"{exc}: give the header values again", field="config.headers") from exc


@sensitive_variables()
def _decrypted(config: dict[str, Any]) -> dict[str, str]:
    # An empty value encrypts to "" (projects.secrets), which decrypts back to "".
    return {name: secrets.decrypt(token) for name, token in (config.get(ENCRYPTED_HEADERS) or {}).items()}
