"""``tinker://{training client}/{weights|sampler_weights|external_weights}/{name}``: the checkpoints a team saved
through the Tinker API, and any platform checkpoint as ``tinker://{project}/{model}/step/{N}``. A name
its team published is readable by every team of this artweb; nothing else crosses teams.

A read of the domain: the Tinker API, its jobs (loading,
sampling, recovery) and its services (copies, the TTL sweep) resolve a path by it alike."""

from __future__ import annotations

import datetime

from django.utils import timezone

from projects.errors import NotFound, ValidationFailed
from projects.models import Checkpoint, Team, TinkerModel
from projects.selectors._scoping import scoped
from training.rollouts.strict_json import parse_int

SCHEME = "tinker://"


def checkpoint_for_path(team: Team, path: str, *, param: str, public: bool = False) -> Checkpoint:
    """The team's checkpoint ``path`` names (another team's is a 404, as a missing one is). With
    ``public``, for reading it (loading, sampling, copying, weights info): also a name another team
    published (``publish_checkpoint_from_tinker_path``)."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise ValidationFailed(f"must be a tinker:// path, got {path!r}", field=param)
    owner, _, rest = path[len(SCHEME) :].partition("/")
    kind, _, name = rest.partition("/")
    if not owner or not name:
        raise ValidationFailed(f"{path!r} is not tinker://<training run>/<weights|sampler_weights>/<name>",
                               field=param)  # fmt: skip
    if kind == "step":  # a platform checkpoint: tinker://<project>.<model>/step/<N>
        project, _, model = owner.partition(".")
        checkpoint = scoped(Checkpoint, team).filter(
            model__project__name=project, model__name=model,
            step=-1 if (step := parse_int(name, low=0)) is None else step,  # 5,000 digits: no step
        ).select_related("model__base_model").first()  # fmt: skip
    elif kind in ("weights", "sampler_weights", "external_weights"):
        # Unscoped on purpose: a name another team published is readable (``public``). One check
        # below decides whether another team's name is: no second place to forget it in.
        tinker = TinkerModel.objects.filter(pk=owner).select_related("session").first()
        checkpoint, label = None, f"{kind}/{name}"
        if tinker is not None:
            for candidate in Checkpoint.objects.filter(model=tinker.model).select_related(
                "model__base_model"
            ):
                if label in candidate.metrics.get("tinker_names", {}):
                    checkpoint = candidate
                    break
            theirs = tinker.session.team_id != team.pk
            if checkpoint is not None and theirs and not (public and is_public(checkpoint, label)):
                checkpoint = None
    else:
        raise ValidationFailed(
            f"{path!r}: the kind is weights, sampler_weights, external_weights or step, not {kind!r}",
            field=param,
        )
    if checkpoint is None or not (checkpoint.storage_key or checkpoint.path):
        raise NotFound(f"no checkpoint {path!r} in your team", field=param)
    if kind != "step" and (expiry := name_expiry(checkpoint, f"{kind}/{name}")) and expiry <= timezone.now():
        raise NotFound(f"{path} expired at {expiry.isoformat()}", field=param)
    return checkpoint


def name_expiry(checkpoint: Checkpoint, label: str) -> datetime.datetime | None:
    """When the name ``label`` (``weights/x`` …) of ``checkpoint`` expires (its TTL), if ever."""
    raw = checkpoint.metrics.get("tinker_exports", {}).get(label, {}).get("expires_at")
    return datetime.datetime.fromisoformat(raw) if raw else None


def is_public(checkpoint: Checkpoint, label: str) -> bool:
    """Whether the name ``label`` (``weights/x`` …) of ``checkpoint`` was published."""
    return label in checkpoint.metrics.get("tinker_public", [])
