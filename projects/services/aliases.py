"""Model aliases and canaries (projects.models.completions.ModelAlias): a name such as
``support/agent:prod`` that the gateway resolves to a checkpoint, a candidate checkpoint that gets
a share of its traffic (sticky per conversation: projects.selectors.serving), promotion and
rollback. Every change is an ``AliasEvent`` with who and when; promotion and rollback send the
team's webhooks (``model_alias.promoted``, ``model_alias.rolled_back``).

Concurrency: every change locks the alias row (``select_for_update``), so two promotions cannot
interleave and an event always describes the state it produced.
"""

from __future__ import annotations

import math
import re
from typing import Any

from django.db import IntegrityError, transaction

from projects.errors import Conflict, ValidationFailed
from projects.models import AliasAction, AliasEvent, ApiKey, Checkpoint, ModelAlias, TrainableModel
from projects.services.webhooks import webhook_emit

ALIAS_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
RESERVED = {"latest"}


def _checkpoint(model: TrainableModel, step: Any, field: str) -> Checkpoint:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValidationFailed("must be a checkpoint's step (a whole number)", field=field)
    checkpoint = Checkpoint.objects.filter(model=model, step=step).first()
    if checkpoint is None:
        raise ValidationFailed(
            f"{model.project.name}/{model.name} has no checkpoint at step {step}", field=field
        )
    return checkpoint


def _event(
    alias: ModelAlias, action: str, by: Any, api_key: ApiKey | None, previous: int | None = None
) -> AliasEvent:
    return AliasEvent.objects.create(
        alias=alias, action=action, checkpoint_step=alias.checkpoint.step,
        candidate_step=alias.candidate.step if alias.candidate else None,
        candidate_share=alias.candidate_share, previous_step=previous, created_by=by, api_key=api_key,
    )  # fmt: skip


def _locked(alias: ModelAlias) -> ModelAlias:
    return (
        ModelAlias.objects.select_for_update(of=("self",))
        .select_related("model__project", "checkpoint", "candidate")
        .get(pk=alias.pk)
    )


def alias_set(
    *, model: TrainableModel, name: str, step: Any, by: Any = None, api_key: ApiKey | None = None
) -> ModelAlias:
    """Create the alias ``name`` of ``model`` at checkpoint ``step``, or move it there (a candidate
    stays as it is)."""
    if not isinstance(name, str) or not ALIAS_NAME.fullmatch(name) or name in RESERVED:
        raise ValidationFailed(
            "must be 1-32 lowercase letters, digits, '_' or '-', starting with a letter, and not 'latest'",
            field="name",
        )
    checkpoint = _checkpoint(model, step, "checkpoint")
    with transaction.atomic():
        alias = ModelAlias.objects.filter(model=model, name=name).first()
        if alias is None:
            try:
                with transaction.atomic():
                    alias = ModelAlias.objects.create(model=model, name=name, checkpoint=checkpoint)
            except IntegrityError:
                raise Conflict(f"alias {name!r} was created meanwhile; retry", field="name") from None
            _event(alias, AliasAction.SET, by, api_key)
            return alias
        alias = _locked(alias)
        previous = alias.checkpoint.step
        alias.checkpoint = checkpoint
        alias.save(update_fields=["checkpoint", "updated_at"])
        _event(alias, AliasAction.SET, by, api_key, previous)
        return alias


def alias_canary(
    *, alias: ModelAlias, step: Any, share: Any, by: Any = None, api_key: ApiKey | None = None
) -> ModelAlias:
    """Send ``share`` (0 < share <= 1) of the alias's conversations to checkpoint ``step``."""
    if (
        isinstance(share, bool)
        or not isinstance(share, int | float)
        or not math.isfinite(share)
        or not 0 < share <= 1
    ):
        raise ValidationFailed("must be a fraction of the traffic, above 0 and at most 1", field="share")
    with transaction.atomic():
        alias = _locked(alias)
        candidate = _checkpoint(alias.model, step, "checkpoint")
        if candidate.pk == alias.checkpoint_id:
            raise ValidationFailed("is the alias's checkpoint already: name another step", field="checkpoint")
        alias.candidate, alias.candidate_share = candidate, float(share)
        alias.save(update_fields=["candidate", "candidate_share", "updated_at"])
        _event(alias, AliasAction.CANARY, by, api_key)
        return alias


def alias_promote(*, alias: ModelAlias, by: Any = None, api_key: ApiKey | None = None) -> ModelAlias:
    """The candidate becomes the alias's checkpoint, with all of its traffic."""
    with transaction.atomic():
        alias = _locked(alias)
        if alias.candidate is None:
            raise Conflict("this alias has no candidate to promote (start a canary first)", field="candidate")
        previous = alias.checkpoint.step
        alias.checkpoint, alias.candidate, alias.candidate_share = alias.candidate, None, 0.0
        alias.save(update_fields=["checkpoint", "candidate", "candidate_share", "updated_at"])
        event = _event(alias, AliasAction.PROMOTE, by, api_key, previous)
        _emit(alias, "model_alias.promoted", event)
        return alias


def alias_rollback(*, alias: ModelAlias, by: Any = None, api_key: ApiKey | None = None) -> ModelAlias:
    """Drop the candidate; with none, move the checkpoint back to the one before the last
    promotion or move."""
    with transaction.atomic():
        alias = _locked(alias)
        previous = alias.checkpoint.step
        if alias.candidate is not None:
            alias.candidate, alias.candidate_share = None, 0.0
        else:
            last = (
                AliasEvent.objects.filter(alias=alias, action__in=[AliasAction.PROMOTE, AliasAction.SET],
                                          previous_step__isnull=False, checkpoint_step=alias.checkpoint.step)
                .order_by("-id").first()
            )  # fmt: skip
            if last is None:
                raise Conflict("nothing to roll back: no candidate, and no checkpoint before this one",
                               field="alias")  # fmt: skip
            alias.checkpoint = _checkpoint(alias.model, last.previous_step, "alias")
        alias.save(update_fields=["checkpoint", "candidate", "candidate_share", "updated_at"])
        event = _event(alias, AliasAction.ROLLBACK, by, api_key, previous)
        _emit(alias, "model_alias.rolled_back", event)
        return alias


def alias_delete(*, alias: ModelAlias) -> None:
    alias.delete()


def _emit(alias: ModelAlias, type: str, event: AliasEvent) -> None:
    model = alias.model
    webhook_emit(team_id=model.project.team_id, type=type, data={
        "alias": f"{model.project.name}/{model.name}:{alias.name}", "checkpoint_step": event.checkpoint_step,
        "previous_step": event.previous_step, "event_id": event.pk,
        "by": event.created_by.username if event.created_by else (f"key {event.api_key.name}" if event.api_key else None),
    })  # fmt: skip
