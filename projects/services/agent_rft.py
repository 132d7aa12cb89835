"""Agent RFT on fine-tuning jobs (OpenAI's reinforcement fine-tuning with tools): a job whose
``method.reinforcement`` names ``tools`` trains in an environment of kind ``http_tools`` made for
it (``training.environments.http_tools``: each call a POST to the tool's endpoint, tagged with the
episode's rollout id and the call id), instead of the one-turn ``fine-tuning-chat`` environment.

    "method": {"type": "reinforcement", "reinforcement": {
        "grader": {...},
        "tools": [{"name": "search", "description": "...", "parameters": {JSON schema},
                   "server_url": "https://tools.example.com/search", "headers": {"Authorization": "..."}}],
        "max_episode_steps": 6,        # model turns per episode, 1 to 50 (default 4)
        "max_tool_calls": 20000}}      # artweb's: calls the job may send, all episodes (default 100000)

A tool may also be given in OpenAI's function-tool shape, ``{"type": "function", "function": {name,
description, parameters}, "server_url", "headers"}``; both are stored in the flat shape above, and
the job echoes its method in that shape (``strict: true`` is refused: calls are parsed from the
model's text, not constrained to the schema). Header values are stored encrypted and never echoed
(``projects.environment_config``: the job's method shows ``********``), and a ``server_url`` is checked
by the operator's outbound policy when the job is created; bad input is a 400 naming the field
(``method.reinforcement.tools[0].server_url``, ``....tools[1].function.name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from projects import environment_config
from projects.errors import ValidationFailed
from projects.models import Environment, EnvironmentKind, Project
from projects.services.environments import environment_create

FIELDS = frozenset({"tools", "max_episode_steps", "max_tool_calls"})  # beside grader in the method's body
WHERE = "method.reinforcement"
MAX_EPISODE_STEPS = 50
DEFAULT_EPISODE_STEPS = 4  # the http_tools kind's default max turns
FUNCTION_KEYS = ("name", "description", "parameters")


@dataclass(frozen=True)
class AgentSettings:
    """A job's tools as the environment takes them (flat shape, plaintext headers) and its limits."""

    tools: list[dict[str, Any]]
    function_shaped: tuple[bool, ...]  # per tool: given in OpenAI's function shape (for error fields)
    max_episode_steps: int
    max_tool_calls: int | None


def agent_settings(method: Any) -> AgentSettings | None:
    """The Agent RFT settings of a job's ``method`` (already checked by ``fine_tuning._method``),
    or None for a job without tools; ValidationFailed naming the field."""
    body = (
        method.get("reinforcement")
        if isinstance(method, dict) and method.get("type") == "reinforcement"
        else None
    )
    if not isinstance(body, dict) or body.get("tools") is None:
        for key in ("max_episode_steps", "max_tool_calls"):
            if isinstance(body, dict) and body.get(key) is not None:
                raise ValidationFailed("only for a job with tools", field=f"{WHERE}.{key}")
        return None
    tools = body["tools"]
    if not isinstance(tools, list) or not tools:
        raise ValidationFailed("must be a non-empty list of tools", field=f"{WHERE}.tools")
    flat = [_flat(tool, f"{WHERE}.tools[{index}]") for index, tool in enumerate(tools)]
    steps = body.get("max_episode_steps")
    if steps is None:
        steps = DEFAULT_EPISODE_STEPS
    elif isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_EPISODE_STEPS:
        raise ValidationFailed(
            f"must be an integer from 1 to {MAX_EPISODE_STEPS}", field=f"{WHERE}.max_episode_steps"
        )
    return AgentSettings(
        tools=flat,
        function_shaped=tuple(isinstance(tool, dict) and "function" in tool for tool in tools),
        max_episode_steps=steps,
        max_tool_calls=body.get("max_tool_calls"),
    )


def _flat(tool: Any, where: str) -> Any:
    """OpenAI's function-tool shape as the flat one; anything else as given (the registry checks it)."""
    if not isinstance(tool, dict) or "type" not in tool:
        return tool
    if tool["type"] != "function":
        raise ValidationFailed('must be "function" (or leave type out)', field=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValidationFailed("must be an object {name, description, parameters}", field=f"{where}.function")
    for key in tool:
        if key not in ("type", "function", "server_url", "headers"):
            raise ValidationFailed(
                "unknown key (allowed: type, function, server_url, headers)", field=f"{where}.{key}"
            )
    for key in function:
        if key == "strict" and function[key]:
            raise ValidationFailed("not supported: calls are parsed from the model's text, not constrained "
                                   "to the schema", field=f"{where}.function.strict")  # fmt: skip
        if key not in FUNCTION_KEYS and key != "strict":
            raise ValidationFailed(
                f"unknown key (allowed: {', '.join(FUNCTION_KEYS)})", field=f"{where}.function.{key}"
            )
    described = {
        key: value for key, value in function.items() if key != "strict"
    }  # strict: false changes nothing
    return {**described, **{key: tool[key] for key in ("server_url", "headers") if key in tool}}


def job_environment(*, project: Project, settings: AgentSettings, name: str) -> Environment:
    """The job's own ``http_tools`` environment (header values encrypted by ``environment_create``);
    a refusal names the job's field."""
    config: dict[str, Any] = {"tools": settings.tools}
    if settings.max_tool_calls is not None:
        config["max_tool_calls"] = settings.max_tool_calls
    try:
        return environment_create(
            project=project, name=name, kind=EnvironmentKind.HTTP_TOOLS, max_turns=settings.max_episode_steps,
            config=config,
        )  # fmt: skip
    except ValidationFailed as exc:
        raise ValidationFailed(exc.message, field=job_field(exc.field or "", settings)) from exc


TOOL_FIELD = re.compile(r"config\.tools\[(\d+)\](?:\.(\w+))?(.*)")


def job_field(field: str, settings: AgentSettings) -> str:
    """An environment field (``config.tools[0].server_url``) as the job's (``method.reinforcement...``)."""
    match = TOOL_FIELD.fullmatch(field)
    if match:
        index, key, rest = int(match.group(1)), match.group(2), match.group(3)
        where = f"{WHERE}.tools[{index}]"
        if key is None:
            return where
        shaped = index < len(settings.function_shaped) and settings.function_shaped[index]
        return f"{where}.function.{key}{rest}" if shaped and key in FUNCTION_KEYS else f"{where}.{key}{rest}"
    if field == "max_turns":
        return f"{WHERE}.max_episode_steps"
    if field == "config.max_tool_calls":
        return f"{WHERE}.max_tool_calls"
    return f"{WHERE}.tools"


def method_echo(environment: Environment) -> dict[str, Any]:
    """What the job's method shows of its tools: as stored (flat), header values masked."""
    shown = environment_config.config_public(environment.config)
    echo: dict[str, Any] = {"tools": shown["tools"], "max_episode_steps": environment.max_turns}
    if "max_tool_calls" in shown:
        echo["max_tool_calls"] = shown["max_tool_calls"]
    return echo
