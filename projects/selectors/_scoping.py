"""Team scoping: every read of a team-owned row goes through ``scoped``, which follows the model's
``TEAM_PATH`` to its team, so a query can never cross teams (another team's id reads as absent)."""

from __future__ import annotations

from typing import Any

from django.db.models import Model, QuerySet

from projects.errors import ValidationFailed
from projects.models import Team


def scoped(model: type[Model], team: Team) -> QuerySet:
    """All rows of ``model`` that belong to ``team``, through the model's ``TEAM_PATH``."""
    return model._default_manager.filter(**{model.TEAM_PATH: team})  # type: ignore[attr-defined]


def scoped_reference(model: type[Model], team: Team, value: Any, *, field: str) -> Any:
    """Resolve an id given in a request body; another team's id reads as not found (400 on that field)."""
    try:
        pk = int(value)
    except (TypeError, ValueError):
        raise ValidationFailed("must be an integer id", field=field) from None
    obj = scoped(model, team).filter(pk=pk).first()
    if obj is None:
        raise ValidationFailed(f"no {model._meta.verbose_name} with id {pk} in your team", field=field)
    return obj
