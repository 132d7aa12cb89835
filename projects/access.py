"""Who is asking, for which team, allowed to do what: the one tenancy resolver.

Every entry point (the REST API's base view, the dashboard's ``team_view``, the playground and the
gateway) turns its caller into a ``TeamAccess`` here and nowhere else, and asks ``allows`` with a
``Permission`` from the one role table. A caller without a team gets ``None``; code never picks a
team by hand, so a row of another team is unreachable rather than merely filtered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from asgiref.sync import sync_to_async

from projects.errors import ValidationFailed
from projects.models import ApiKey, Membership, Role, Team


class Permission(StrEnum):
    READ = "read"  # see the team's rows
    WRITE = "write"  # create, change and delete projects, runs, evaluations …
    MANAGE = "manage"  # the team itself: members, API keys, judge endpoints' secrets


ROLE_PERMISSIONS: dict[str, frozenset[Permission]] = {
    Role.OWNER: frozenset({Permission.READ, Permission.WRITE, Permission.MANAGE}),
    Role.MEMBER: frozenset({Permission.READ, Permission.WRITE}),
    Role.VIEWER: frozenset({Permission.READ}),
}

DENIED_MESSAGES: dict[Permission, str] = {
    Permission.READ: "You need a team membership or API key for this.",
    Permission.WRITE: "Viewers have read-only access to this team (a read-only API key acts as a viewer).",
    Permission.MANAGE: "Only team owners can do this.",
}


@dataclass(frozen=True)
class TeamAccess:
    """The caller's team and role. ``api_key`` is set for key callers (keys belong to teams, not
    people: a read-write key acts as a member, a read-only key as a viewer); ``memberships`` holds
    a signed-in person's teams (the dashboard's team switcher)."""

    team: Team
    role: str
    api_key: ApiKey | None = None
    memberships: list[Membership] = field(default_factory=list)

    def allows(self, permission: Permission) -> bool:
        return permission in ROLE_PERMISSIONS.get(self.role, frozenset())


def key_role(api_key: ApiKey) -> str:
    return Role.VIEWER if api_key.read_only else Role.MEMBER


class TeamNotChosen(ValidationFailed):
    """A signed-in person with several teams called the API without saying which one."""

    code = "team_required"


def _most_recent(memberships: list[Membership]) -> Membership:
    """The team the person last chose (``last_used_at``), else the one they joined last."""
    return max(memberships, key=lambda m: (m.last_used_at or m.created_at, m.pk))


def resolve_team_and_role(
    *,
    api_key: ApiKey | None = None,
    user: Any = None,
    team_name: str | None = None,
    preferred_team_id: Any = None,
    remembered: bool = False,
) -> TeamAccess | None:
    """The caller's ``TeamAccess``, or None when it acts for no team.

    A key gives its own team. A signed-in ``user`` gives the team named by ``team_name`` (strict:
    not a member of it → None), else the team ``preferred_team_id`` (the dashboard session's
    choice) while still a member, else their only team. With several teams and none of those,
    ``remembered`` (the dashboard) takes the team they last chose, or joined last; otherwise (the
    REST API) it is a ``TeamNotChosen`` 400 naming ``X-Team``. Never a team picked by its name's
    order: which team a write lands in is the caller's choice.
    """
    if api_key is not None:
        return TeamAccess(team=api_key.team, role=key_role(api_key), api_key=api_key)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    memberships = list(Membership.objects.select_related("team").filter(user=user).order_by("team__name"))
    chosen: Membership | None
    if team_name:
        chosen = next((m for m in memberships if m.team.name == team_name), None)
    elif preferred_team_id is not None and any(m.team_id == preferred_team_id for m in memberships):
        chosen = next(m for m in memberships if m.team_id == preferred_team_id)
    elif len(memberships) <= 1:
        chosen = memberships[0] if memberships else None
    elif remembered:
        chosen = _most_recent(memberships)
    else:
        names = ", ".join(m.team.name for m in memberships)
        raise TeamNotChosen(
            f"you belong to several teams: say which one with the X-Team header (one of: {names})",
            field="X-Team",
        )
    if chosen is None:
        return None
    return TeamAccess(team=chosen.team, role=chosen.role, memberships=memberships)


aresolve_team_and_role = sync_to_async(resolve_team_and_role)
