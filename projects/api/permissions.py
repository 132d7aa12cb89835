"""The API's one permission check (the settings' default): the caller's team and role from
``projects.access``, and the permission the view needs (``projects.api.base.CallerViewSet``).

Kept apart from ``base`` because DRF imports its default permission classes while
``rest_framework.views`` itself is being imported.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from projects.access import DENIED_MESSAGES, Permission, TeamAccess, resolve_team_and_role
from projects.models import ApiKey

_ACCESS_ATTRIBUTE = "team_access"


def request_access(request: Request) -> TeamAccess | None:
    """The caller's team and role, resolved once per request (key, or session + ``X-Team``)."""
    if not hasattr(request, _ACCESS_ATTRIBUTE):
        api_key = request.auth if isinstance(request.auth, ApiKey) else None
        team_name = request.headers.get("X-Team") or request.query_params.get("team")
        access = resolve_team_and_role(api_key=api_key, user=request.user, team_name=team_name)
        setattr(request, _ACCESS_ATTRIBUTE, access)
    return getattr(request, _ACCESS_ATTRIBUTE)


class TeamPermission(BasePermission):
    """Reads need ``Permission.READ``; any other method the view's ``write_permission``."""

    message = DENIED_MESSAGES[Permission.READ]

    def has_permission(self, request: Request, view: Any) -> bool:
        if not hasattr(view, "required_permission"):  # the settings' default: a view outside the base
            self.message = "This view is not team-scoped; derive it from projects.api.base."
            return False
        access = request_access(request)
        if access is None:
            return False
        needed = view.required_permission(request)
        if not access.allows(needed):
            self.message = DENIED_MESSAGES[needed]
            return False
        return True
