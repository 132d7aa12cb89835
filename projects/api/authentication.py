"""API key authentication (``Authorization: Bearer aw_…``) and the caller's team.

``request.team`` and ``request.role`` are resolved once here (or in ``resolve_team`` for session
users) and used by the one scoping base class; views never pick a team themselves.
"""

from __future__ import annotations

from rest_framework import authentication, exceptions
from rest_framework.request import Request

from projects import services
from projects.models import ApiKey, Membership, Role


class ApiKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        parts = header.split()
        if len(parts) != 2 or parts[0] != self.keyword:
            raise exceptions.AuthenticationFailed("use 'Authorization: Bearer <api key>'")
        api_key = services.api_key_authenticate(raw=parts[1])
        if api_key is None:
            raise exceptions.AuthenticationFailed("invalid or revoked API key")
        return (ApiKeyUser(api_key), api_key)

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


class ApiKeyUser:
    """The principal of a key-authenticated request (keys belong to teams, not people)."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    pk = None
    id = None

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key

    def __str__(self) -> str:
        return f"api-key:{self.api_key.prefix}"


def resolve_team(request: Request) -> tuple[object | None, str | None]:
    """Return (team, role) of the caller. A key gives its team (role ``viewer`` if read-only);
    a signed-in user gives the team named by the ``X-Team`` header or ``?team=``, or their first."""
    if isinstance(request.auth, ApiKey):
        return request.auth.team, (Role.VIEWER if request.auth.read_only else Role.MEMBER)
    user = request.user
    if not user or not user.is_authenticated:
        return None, None
    memberships = Membership.objects.select_related("team").filter(user=user).order_by("team__name")
    wanted = request.headers.get("X-Team") or request.query_params.get("team")
    if wanted:
        memberships = memberships.filter(team__name=wanted)
    membership = memberships.first()
    if membership is None:
        return None, None
    return membership.team, membership.role
