"""Reads for the gateway: a request's ``Route`` (its checkpoint, live servers and decoded body),
OpenPipe ART's names for a team's checkpoints, and the models a team may call.

Which checkpoint a model id names and which live servers serve it, best first, are domain reads
(projects.selectors.serving: ``resolve_model``, ``live_servers``).

A request's ``Route`` carries everything resolved before forwarding, the body decoded and
validated once (``ParsedChat``) included, so no later step decodes it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from projects.gateway.capture import Capture, StoreFields
from projects.models import ApiKey, BaseModel, InferenceServer, Run, RunKind, Team
from projects.selectors import scoped
from projects.selectors.serving import ART_ALIAS, Target
from projects.selectors.steps import team_checkpoint_names
from training.serving.protocol import ChatRequest

__all__ = [
    "ParsedChat",
    "Route",
    "art_alias",
    "available_models",
    "names_latest",
]


def art_alias(team: Team, project: str, model: str, step: int | None = None) -> str:
    """The name OpenPipe ART's ServerlessBackend gives a checkpoint (latest when ``step`` is None)."""
    name = f"wandb-artifact:///{team.name}/{project}/{model}"
    return name if step is None else f"{name}:step{step}"


def names_latest(model_id: str) -> bool:
    """Whether ``model_id`` names a model's latest checkpoint through ART's alias: such routes are
    never remembered (projects.gateway.lookups), so the step a training job has just recorded is
    what the client samples next, as ART expects right after ``training_ended``."""
    match = ART_ALIAS.fullmatch(model_id)
    return match is not None and match["step"] is None


@dataclass(frozen=True)
class ParsedChat:
    """A chat completion body, decoded and validated once."""

    raw: bytes  # as the client sent it: our own servers get it unchanged
    decoded: dict[str, Any]  # the JSON object: vLLM's body is rewritten from it
    request: ChatRequest  # validated with Limits.shape_only() (every server applies its own limits)
    # Logprobs asked, not streamed: raw and decoded ask return_token_ids and the reply's choices
    # get their ids (projects.gateway.token_ids); the top-level ids stay if the client asked.
    annotate: bool = False
    keep_prompt_token_ids: bool = False
    store: StoreFields = StoreFields(None, {})  # ``store`` and ``metadata``, checked (capture)


@dataclass
class Route:
    """Where a chat completion goes, and what it is: everything settled before forwarding."""

    api_key: ApiKey | None  # None: a signed-in dashboard user (the playground); not metered per key
    target: Target
    servers: list[InferenceServer]  # live, best first
    chat: ParsedChat
    capture: Capture | None = None  # stored (projects.gateway.capture): set by with_capture

    @property
    def stream(self) -> bool:
        return self.chat.request.stream


def available_models(*, team: Team) -> list[dict]:
    """OpenAI's model objects: every base model, and each of the team's checkpoints (with a
    ``:latest`` alias per trainable model)."""
    data = [
        {
            "id": base.name,
            "object": "model",
            "created": int(base.created_at.timestamp()),
            "owned_by": "artweb",
        }
        for base in BaseModel.objects.order_by("name")
    ]
    # Per trainable model (and, negated, its ART name) the last row, which is its newest checkpoint.
    latest: dict[int, tuple[dict, str]] = {}
    aliases: list[dict] = []
    client_models = set(scoped(Run, team).filter(kind=RunKind.CLIENT).values_list("model_id", flat=True))
    for model_id, project_name, model_name, step, created in team_checkpoint_names(team=team):
        item = {
            "id": f"{project_name}/{model_name}:{step}",
            "object": "model",
            "created": created,
            "owned_by": team.name,
        }
        data.append(item)
        latest[model_id] = (item, f"{project_name}/{model_name}:latest")
        if model_id in client_models:  # trained through /v1/preview/: ART's names too
            aliases.append({**item, "id": art_alias(team, project_name, model_name, step)})
            latest[-model_id] = (item, art_alias(team, project_name, model_name))
    return data + aliases + [{**item, "id": name} for item, name in latest.values()]
