"""Reads for serving a model: which checkpoint a model id names (within the caller's team) and which
live inference servers can serve it. The gateway routes by them (projects.gateway.routing); an
evaluation resolves its subject by them (selectors.model_id_resolve); a run or a Tinker sampler
that rolls out on an inference server picks one by them (projects.jobs).

Model ids: ``<project>/<model>:<step>``, ``<project>/<model>:latest`` (also plain
``<project>/<model>``), ``<project>/<model>:<alias>`` (a ModelAlias, e.g. ``:prod``, with its
canary), or a base model's catalogue name. Another team's checkpoint is looked up
through the team-scoped queryset, so it reads exactly like a missing one (404). OpenPipe ART's
client names checkpoints ``wandb-artifact:///<team>/<project>/<model>`` (latest) and
``…:step<N>``: aliases of ``<project>/<model>:latest|<N>``, for the caller's own team only.

A checkpoint without files (a client model's step 0, see projects.models.Checkpoint) is the
untrained adapter, i.e. the base model: its target has no adapter path and the base model answers.

Server choice is rendezvous hashing on the checkpoint: every gateway process sends a given
checkpoint to the same live server, so its adapter stays loaded there instead of thrashing every
server's LRU; when that server dies, its checkpoints spread over the others.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from projects.client_names import client_slug
from projects.errors import NotFound
from projects.models import BaseModel, Checkpoint, InferenceServer, ModelAlias, Team
from projects.selectors._scoping import scoped
from training.rollouts.strict_json import parse_int, storable

# Matched with fullmatch: with match and "$", a model id ending in a newline would pass.
CHECKPOINT_ID = re.compile(
    r"(?P<project>[a-z0-9][a-z0-9._-]{0,62})/(?P<model>[a-z0-9][a-z0-9._-]{0,62})"
    r"(?::(?P<tag>latest|\d+|[a-z][a-z0-9_-]{0,31}))?"
)
# ART's names may be any line without "/" (projects.client_names): stored as their slugs.
ART_ALIAS = re.compile(
    r"wandb-artifact:///(?P<team>[^/]+)/(?P<project>[^/\n]{1,200})/"
    r"(?P<model>[^/\n]{1,200}?)(?::(?:step(?P<step>\d+)|latest))?"
)


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model_id: str) -> None:
        # OpenAI's wording: existence and access are not distinguished.
        super().__init__(
            f"The model `{model_id}` does not exist or you do not have access to it.", field="model"
        )


@dataclass(frozen=True)
class Target:
    model_id: str  # the resolved public id (":latest" replaced by the step), echoed in responses
    base_model: BaseModel
    checkpoint: Checkpoint | None  # None: the base model itself

    @property
    def adapter_path(self) -> str | None:
        return (self.checkpoint.path or None) if self.checkpoint else None


def names_alias(model_id: str) -> bool:
    """Whether ``model_id`` names a model alias (``project/model:prod``): resolved per request,
    since a canary splits its traffic (never remembered by the gateway)."""
    match = CHECKPOINT_ID.fullmatch(model_id)
    return (
        match is not None
        and match["tag"] is not None
        and match["tag"] != "latest"
        and not match["tag"].isdigit()
    )


def split_point(alias_id: int, key: str) -> float:
    """Where ``key`` (a conversation id) falls in [0, 1) for alias ``alias_id``: the same key
    always falls in the same place, so a conversation stays on one checkpoint."""
    digest = hashlib.blake2b(f"{alias_id}\n{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _alias_target(team: Team, match: re.Match, split_key: str | None) -> Target | None:
    alias = (
        scoped(ModelAlias, team)
        .select_related("model__base_model", "model__project", "checkpoint", "candidate")
        .filter(model__project__name=match["project"], model__name=match["model"], name=match["tag"])
        .first()
    )
    if alias is None:
        return None
    checkpoint = alias.checkpoint
    if (
        alias.candidate is not None
        and split_key is not None
        and split_point(alias.pk, split_key) < alias.candidate_share
    ):
        checkpoint = alias.candidate
    model = alias.model
    return Target(f"{model.project.name}/{model.name}:{checkpoint.step}", model.base_model, checkpoint)


def resolve_model(*, team: Team, model_id: str, split_key: str | None = None) -> Target:
    """The checkpoint ``model_id`` names for ``team``. An alias with a canary sends the share of
    ``split_key``s its candidate has to the candidate; without a ``split_key`` (an evaluation, a
    run), the alias's own checkpoint."""
    if not storable(model_id):  # a NUL in a JSON body: PostgreSQL cannot even compare it
        raise ModelNotFound(model_id)
    alias = ART_ALIAS.fullmatch(model_id)
    if alias is not None:
        if alias["team"] != team.name:
            raise ModelNotFound(model_id)
        tag = alias["step"] or "latest"
        project, model = client_slug(alias["project"]), client_slug(alias["model"])
        try:
            target = resolve_model(team=team, model_id=f"{project}/{model}:{tag}")
        except ModelNotFound:
            raise ModelNotFound(model_id) from None
        if target.checkpoint is None:  # a base model that happens to be named like the pair
            raise ModelNotFound(model_id)
        # Replies name the model as the client did.
        return replace(target, model_id=f"{alias['project']}/{alias['model']}:{target.checkpoint.step}")
    match = CHECKPOINT_ID.fullmatch(model_id)
    if match and names_alias(model_id):
        aliased = _alias_target(team, match, split_key)
        if aliased is not None:
            return aliased
        match = None  # no such alias: a base model may still be named so
    if match:
        checkpoints = (
            scoped(Checkpoint, team)
            .select_related("model__base_model", "model__project")
            .filter(model__project__name=match["project"], model__name=match["model"])
        )
        tag = match["tag"] or "latest"
        step = parse_int(tag, low=0)  # None past 64 bits (``:999…999``): no such checkpoint
        checkpoint = (
            checkpoints.order_by("-step").first()
            if tag == "latest"
            else checkpoints.filter(step=step).first()
            if step is not None
            else None
        )
        if checkpoint is not None:
            model = checkpoint.model
            return Target(
                f"{model.project.name}/{model.name}:{checkpoint.step}", model.base_model, checkpoint
            )
    base_model = BaseModel.objects.filter(name=model_id).first()
    if base_model is not None:
        return Target(base_model.name, base_model, None)
    raise ModelNotFound(model_id)


def live_servers(*, base_model: BaseModel, affinity: str) -> list[InferenceServer]:
    """Servers of ``base_model`` with a fresh heartbeat, best first for ``affinity`` (the
    checkpoint path, or the base model name)."""
    fresh_since = timezone.now() - timedelta(seconds=settings.INFERENCE_HEARTBEAT_TIMEOUT_S)
    servers = list(InferenceServer.objects.filter(base_model=base_model, heartbeat_at__gte=fresh_since))
    return sorted(servers, key=lambda server: _rendezvous(server.url, affinity), reverse=True)


def _rendezvous(url: str, affinity: str) -> bytes:
    return hashlib.blake2b(f"{url}\n{affinity}".encode(), digest_size=8).digest()
