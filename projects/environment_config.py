"""Environment settings that the operator or a secret decides, in one place for the services, the
API, the dashboard and the workers: the stdio program allow-list and write-only request headers.

Safety invariant: an MCP environment's `config.headers` values (e.g. `Authorization`), and each
http_tools tool's `config.tools[i].headers`, are stored only as Fernet ciphertext (`headers_encrypted`
beside them, `projects.secrets`), are never rendered (`config_public` shows `MASK`), and are
decrypted only to build the environment (`config_for_build`). Stored values are sent only to the
URL they were entered for: a changed `config.url` (a tool's `server_url`) needs them again
(`projects.secrets.secret_follows_url`), so nobody who can edit but not read an environment can
redirect them elsewhere.
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
    """The config as the API and the dashboard show it: header names with `MASK` for their values
    (an MCP config's own, and each http_tools tool's)."""
    shown = _public(config, "url")
    if _tool_list(config):
        shown["tools"] = [
            _public(tool, "server_url") if isinstance(tool, dict) else tool for tool in config["tools"]
        ]
    return shown


def _public(holder: dict[str, Any], url_key: str) -> dict[str, Any]:
    shown = {key: value for key, value in holder.items() if key not in ("headers", ENCRYPTED_HEADERS)}
    if isinstance(shown.get(url_key), str):
        shown[url_key] = secrets.url_public(shown[url_key])  # a credential stored before input refused it
    names = list(holder.get(ENCRYPTED_HEADERS) or {}) + list(holder.get("headers") or {})
    if names:
        shown["headers"] = {name: MASK for name in names}
    return shown


@sensitive_variables("plain")  # decrypted header values
def config_for_build(config: dict[str, Any]) -> dict[str, Any]:
    """The config with plaintext headers, for the worker that connects to the server or endpoints.
    Raises ValueError when a stored value cannot be decrypted (SECRET_KEY changed)."""
    plain = _plain(config)
    if _tool_list(config):
        plain["tools"] = [_plain(tool) if isinstance(tool, dict) else tool for tool in config["tools"]]
    return plain


@sensitive_variables("plain")
def _plain(holder: dict[str, Any]) -> dict[str, Any]:
    if ENCRYPTED_HEADERS not in holder:
        return dict(holder)
    plain = {key: value for key, value in holder.items() if key != ENCRYPTED_HEADERS}
    plain["headers"] = _decrypted(holder)
    return plain


def config_with_kept_headers(config: Any, *, stored: dict[str, Any]) -> Any:
    """The config a write asked for, with the stored header values put back where it keeps them:
    a value equal to `MASK` keeps that header's stored value, and a config without `headers` keeps
    all of them; both only while `config.url` is the stored one. Other values replace the stored
    ones, and a header left out of a given `headers` object is removed. An http_tools tool keeps
    the stored values of the stored tool of its name by the same rule, while its `server_url` is
    that tool's. Anything malformed is left for the registry's validation to name."""
    if not isinstance(config, dict):
        return config
    config = _kept(config, stored, url_key="url", where="config")
    if _tool_list(config):
        stored_tools: list[Any] = stored["tools"] if _tool_list(stored) else []
        by_name = {tool.get("name"): tool for tool in stored_tools if isinstance(tool, dict)}
        config = {
            **config,
            "tools": [
                _kept(
                    tool,
                    by_name.get(tool.get("name")) or {},
                    url_key="server_url",
                    where=f"config.tools[{index}]",
                )
                if isinstance(tool, dict)
                else tool
                for index, tool in enumerate(config["tools"])
            ],
        }
    return config


def _kept(holder: dict[str, Any], stored: dict[str, Any], *, url_key: str, where: str) -> dict[str, Any]:
    """`config_with_kept_headers` for one holder of a URL and its headers (`where` names it)."""
    if url_key not in holder:
        return holder
    headers = holder.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return holder
    stored_names = list(stored.get(ENCRYPTED_HEADERS) or {}) + list(stored.get("headers") or {})
    masked = [name for name, value in (headers or {}).items() if value == MASK]
    if not masked and (headers is not None or not stored_names):
        return holder
    same_url = stored_names and holder[url_key] == stored.get(url_key)
    if not same_url:
        secrets.secret_follows_url(
            stored_url=stored.get(url_key) or "",
            url=holder[url_key],
            has_stored_secret=bool(stored_names),
            secret_given=headers is not None,
            url_field=f"{where}.{url_key}",
            secret_field=f"{where}.headers",
            empty="{}",
        )
        raise ValidationFailed(
            "give the value: there is no stored value for this URL to keep",
            field=f"{where}.headers.{masked[0]}",
        )
    kept = _stored_headers(stored, where=where)
    if headers is None:
        return {**holder, "headers": kept}
    for name in masked:
        if name not in kept:
            raise ValidationFailed(
                "give the value: no value is stored for this header", field=f"{where}.headers.{name}"
            )
    return {
        **holder,
        "headers": {name: kept[name] if value == MASK else value for name, value in headers.items()},
    }


def config_for_storage(config: dict[str, Any]) -> dict[str, Any]:
    """A validated config as stored: header values encrypted, under `headers_encrypted` (the
    config's own, and each http_tools tool's)."""
    stored = _for_storage(config)
    if _tool_list(config):
        stored["tools"] = [_for_storage(tool) if isinstance(tool, dict) else tool for tool in config["tools"]]
    return stored


def _for_storage(holder: dict[str, Any]) -> dict[str, Any]:
    headers = holder.get("headers")
    stored = {key: value for key, value in holder.items() if key != "headers"}
    if headers:
        stored[ENCRYPTED_HEADERS] = {name: secrets.encrypt(value) for name, value in headers.items()}
    return stored


def _tool_list(config: dict[str, Any]) -> bool:
    """Whether `config.tools` is an http_tools list of tool objects (each with its URL and headers)."""
    return isinstance(config.get("tools"), list)


@sensitive_variables()
def _stored_headers(stored: dict[str, Any], *, where: str) -> dict[str, str]:
    try:
        return {**(stored.get("headers") or {}), **_decrypted(stored)}
    except ValueError as exc:
        raise ValidationFailed(f"{exc}: give the header values again", field=f"{where}.headers") from exc


@sensitive_variables()
def _decrypted(config: dict[str, Any]) -> dict[str, str]:
    # An empty value encrypts to "" (projects.secrets), which decrypts back to "".
    return {name: secrets.decrypt(token) for name, token in (config.get(ENCRYPTED_HEADERS) or {}).items()}
