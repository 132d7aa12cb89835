"""Environments: the registry's per-kind rules (``training.environments``) checked on every write,
and the one place an environment is built for use, with its MCP and http_tools header values
decrypted (``projects.environment_config``)."""

from __future__ import annotations

from typing import Any

from projects import environment_config, secrets
from projects.errors import ValidationFailed
from projects.models import Environment, EnvironmentKind, Project
from projects.outbound import outbound_policy, outbound_url_checked
from projects.services._common import (
    check_slug,
    check_storable,
    check_text_length,
    config_invalid,
    create_unique,
    delete_unless_used,
)
from training.config import ConfigError, TrainConfig

_SAMPLING_KEYS = {"temperature", "top_p", "max_new_tokens", "stop"}
# Long enough for a detailed prompt with examples (~25k tokens), far below what the body limit lets
# through; it is sent with every rollout.
SYSTEM_PROMPT_MAX_CHARS = 100_000


def _environment_fields(
    kind: str,
    system_prompt: str,
    max_turns: int | None,
    tools: Any,
    sampling: Any,
    config: Any = None,
    tool_timeout_s: Any = 10.0,
    stored_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every field checked by the environment registry's per-kind rules (training.environments):
    `max_turns=None` takes the kind's default; errors name the field (`config.<key>`, `tools`).
    MCP header values: masked ones keep `stored_config`'s (see projects.environment_config); the
    registry checks the plaintext, the returned config holds them encrypted."""
    from training.environments import validate_environment

    if kind not in EnvironmentKind.values:
        raise ValidationFailed(f"must be one of {', '.join(EnvironmentKind.values)}", field="kind")
    for name, value in (("system_prompt", system_prompt), ("tools", tools), ("sampling", sampling),
                        ("config", config)):  # fmt: skip
        check_storable(value, field=name)
    check_text_length(system_prompt, field="system_prompt", max_chars=SYSTEM_PROMPT_MAX_CHARS)
    if isinstance(config, dict) and isinstance(config.get("url"), str):
        secrets.url_credentials_refused(config["url"], field="config.url")
        # Before the stored headers are matched to it: the URL in the form it is stored and called.
        config = {**config, "url": outbound_url_checked(config["url"], field="config.url")}
    if (
        kind == EnvironmentKind.HTTP_TOOLS
        and isinstance(config, dict)
        and isinstance(config.get("tools"), list)
    ):
        config = {
            **config,
            "tools": [_endpoint_checked(tool, index) for index, tool in enumerate(config["tools"])],
        }
    config = environment_config.config_with_kept_headers(config, stored=stored_config or {})
    try:
        checked = validate_environment(
            kind,
            config=config,
            tools=tools,
            max_turns=max_turns,
            tool_timeout_s=tool_timeout_s,
            stdio=environment_config.mcp_stdio_policy(),
        )
    except ConfigError as exc:
        raise ValidationFailed(exc.message, field=exc.field) from exc
    if not isinstance(sampling, dict):
        raise ValidationFailed("must be an object", field="sampling")
    for key in sampling:
        if key not in _SAMPLING_KEYS:
            raise ValidationFailed(
                f"unknown key (allowed: {', '.join(sorted(_SAMPLING_KEYS))})", field=f"sampling.{key}"
            )
    stop = sampling.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValidationFailed("must be a list of non-empty strings", field="sampling.stop")
    overrides = {k: v for k, v in sampling.items() if k != "stop"}
    try:
        TrainConfig.from_dict(overrides)
    except ConfigError as exc:
        raise config_invalid(exc, "sampling.") from exc
    return {
        "kind": kind,
        "system_prompt": system_prompt,
        "max_turns": checked["max_turns"],
        "tools": checked["tools"],
        "config": environment_config.config_for_storage(checked["config"]),
        "tool_timeout_s": float(tool_timeout_s),
        "sampling": sampling,
    }


def _endpoint_checked(tool: Any, index: int) -> Any:
    """An http_tools tool with its `server_url` as stored and called, refused like `config.url`."""
    if not isinstance(tool, dict) or not isinstance(tool.get("server_url"), str):
        return tool  # the registry names what is wrong with it
    where = f"config.tools[{index}].server_url"
    secrets.url_credentials_refused(tool["server_url"], field=where)
    return {**tool, "server_url": outbound_url_checked(tool["server_url"], field=where)}


def environment_create(
    *,
    project: Project,
    name: str,
    kind: str = EnvironmentKind.CHAT,
    system_prompt: str = "",
    max_turns: int | None = None,
    tools: Any = None,
    sampling: Any = None,
    config: Any = None,
    tool_timeout_s: float = 10.0,
) -> Environment:
    check_slug(name, "name")
    fields = _environment_fields(
        kind, system_prompt, max_turns, tools or [], sampling or {}, config or {}, tool_timeout_s
    )
    return create_unique(
        lambda: Environment.objects.create(project=project, name=name, **fields),
        field="name",
        message=f"an environment named {name!r} already exists in this project",
    )


def environment_update(*, environment: Environment, **changes: Any) -> Environment:
    current = {
        "kind": environment.kind,
        "system_prompt": environment.system_prompt,
        "max_turns": environment.max_turns,
        "tools": environment.tools,
        "sampling": environment.sampling,
        # As the API shows it: masked header values, which keep the stored ones (the URL unmasked).
        "config": environment_config.config_public(environment.config)
        | ({"url": environment.config["url"]} if "url" in environment.config else {}),
        "tool_timeout_s": environment.tool_timeout_s,
    }
    stored_config = environment.config
    if changes.get("kind", environment.kind) != environment.kind:
        # Another kind: its own defaults, unless given (a chat's one turn is no game of tic-tac-toe).
        current.update(max_turns=None, tools=[], config={})
        stored_config = {}
    current.update({k: v for k, v in changes.items() if k in current})
    for key, value in _environment_fields(**current, stored_config=stored_config).items():
        setattr(environment, key, value)
    environment.save()
    return environment


def environment_delete(*, environment: Environment) -> None:
    delete_unless_used(environment, "environment")


def environment_build(*, environment: Environment, interactive: bool = False) -> Any:
    """The environment a run trains in, an evaluation drives and whose tools scenario generation
    shows, built from the registry with the stored MCP header values decrypted. Close it when done
    (an MCP session). `interactive`: for a web request, which waits only briefly for a sandbox slot
    (training.safety.slots.SlotsBusy, a 429) where a worker queues."""
    from training.environments import build_environment

    return build_environment(
        environment.kind,
        config=environment_config.config_for_build(environment.config),
        tools=environment.tools,
        system_prompt=environment.system_prompt,
        max_turns=environment.max_turns,
        tool_timeout_s=environment.tool_timeout_s,
        stdio=environment_config.mcp_stdio_policy(
            team_id=environment.project.team_id, interactive=interactive
        ),
        outbound=outbound_policy(),
    )
