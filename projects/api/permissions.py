from rest_framework.permissions import SAFE_METHODS, BasePermission

from projects.api.authentication import resolve_team
from projects.models import Role


class IsTeamMember(BasePermission):
    """Any member may read; owners and members may write; viewers and read-only keys may not."""

    message = "You need a team membership or API key for this."

    def has_permission(self, request, view) -> bool:
        if not hasattr(request, "team"):
            request.team, request.role = resolve_team(request)
        if request.team is None:
            return False
        if request.method in SAFE_METHODS:
            return True
        if request.role == Role.VIEWER:
            self.message = "This API key or membership is read-only."
            return False
        return True


class IsTeamOwner(IsTeamMember):
    def has_permission(self, request, view) -> bool:
        if not super().has_permission(request, view):
            return False
        if request.method not in SAFE_METHODS and request.role != Role.OWNER:
            self.message = "Only team owners can do this."
            return False
        return True
