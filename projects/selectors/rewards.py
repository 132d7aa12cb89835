"""Reads of reward definitions and their versions."""

from __future__ import annotations

from django.db.models import QuerySet

from projects.models import Project, RewardDefinition, Team
from projects.selectors._scoping import scoped


def reward_definitions_latest(*, team: Team, project: Project) -> list[RewardDefinition]:
    """The newest version of each reward definition name in ``project``."""
    definitions = scoped(RewardDefinition, team).filter(project=project).order_by("name", "-version")
    latest: dict[str, RewardDefinition] = {}
    for definition in definitions:
        latest.setdefault(definition.name, definition)
    return list(latest.values())


def reward_definition_versions(*, definition: RewardDefinition) -> QuerySet[RewardDefinition]:
    return RewardDefinition.objects.filter(project=definition.project, name=definition.name).order_by(
        "-version"
    )
