"""Endpoint graders' header values (`training.rewards.endpoint`) are team secrets: kept the way an
MCP server's headers are (`projects.environment_config`), in every endpoint node of a grader spec,
`multi`'s sub-graders included.

Safety invariant: a stored grader spec (a reward definition's, and so a fine-tuning job's) holds
an endpoint grader's header values only as Fernet ciphertext (`headers_encrypted`); readers get
`grader_public` (values shown as MASK); only the code that grades (`grader_for_build`) sees
plaintext. A stored value is sent only to the URL it was entered for, and a masked value written
back keeps the stored one (`grader_with_kept_headers`), so a spec read, edited and written back
keeps its secrets without anyone reading them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.views.decorators.debug import sensitive_variables

from projects import environment_config
from projects.errors import ValidationFailed
from projects.outbound import outbound_url_checked

ENDPOINT = "endpoint"


def _each_endpoint(spec: Any, change: Callable[[dict[str, Any], str], dict[str, Any]], path: str = "") -> Any:
    """`spec` with `change(node, path)` applied to every endpoint node; `path` is the node's place
    under the spec (`""`, `.graders.check`)."""
    if not isinstance(spec, dict):
        return spec
    if spec.get("type") == ENDPOINT:
        return change(spec, path)
    graders = spec.get("graders")
    if spec.get("type") == "multi" and isinstance(graders, dict):
        return {
            **spec,
            "graders": {
                key: _each_endpoint(sub, change, f"{path}.graders.{key}") for key, sub in graders.items()
            },
        }
    return spec


def grader_urls_checked(spec: dict[str, Any], *, field: str) -> dict[str, Any]:
    """A validated spec with each endpoint URL as called (IDNA host), after the operator's outbound
    policy accepted it: ValidationFailed naming `<field>.url` (`spec.graders.check.url`) otherwise."""

    def checked(node: dict[str, Any], path: str) -> dict[str, Any]:
        return {**node, "url": outbound_url_checked(node["url"], field=f"{field}{path}.url")}

    return _each_endpoint(spec, checked)


def grader_for_storage(spec: dict[str, Any]) -> dict[str, Any]:
    """A validated spec as stored: endpoint header values encrypted."""
    return _each_endpoint(spec, lambda node, _: environment_config.config_for_storage(node))


def grader_public(spec: Any) -> Any:
    """A stored spec as any reader sees it: endpoint header names with MASK for their values
    (plaintext stored before this rule is masked too)."""
    return _each_endpoint(spec, lambda node, _: environment_config.config_public(node))


@sensitive_variables()
def grader_for_build(spec: dict[str, Any]) -> dict[str, Any]:
    """A stored spec with plaintext headers, for the code that grades (never stored or shown).
    Raises ValueError when a stored value cannot be decrypted (SECRET_KEY changed)."""
    return _each_endpoint(spec, lambda node, _: environment_config.config_for_build(node))


@sensitive_variables()
def grader_with_kept_headers(spec: Any, *, stored: dict[str, Any], field: str) -> Any:
    """The spec a write asked for, with MASK header values (or a node without `headers`) taking
    the stored value of the endpoint node at the same place, while its `url` is unchanged
    (`environment_config.config_with_kept_headers`, errors naming `<field>.graders.….headers`)."""

    def kept(node: dict[str, Any], path: str) -> dict[str, Any]:
        stored_node = _node_at(stored, path)
        if stored_node.get("type") != ENDPOINT:
            stored_node = {}
        try:  # the node has an MCP config's url + headers shape; only the paths it names differ
            kept_node: dict[str, Any] = environment_config.config_with_kept_headers(node, stored=stored_node)
        except ValidationFailed as exc:
            where = f"{field}{path}" + (exc.field or "config").removeprefix("config")
            raise ValidationFailed(exc.message, field=where) from exc
        return kept_node

    return _each_endpoint(spec, kept)


def _node_at(spec: Any, path: str) -> dict[str, Any]:
    node = spec
    for key in [part for part in path.split(".") if part]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}
