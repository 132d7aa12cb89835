"""Who is asking, for which team: every dashboard view is wrapped in ``team_view``.

The team and role come from ``projects.access.resolve_team_and_role`` (the same resolver the API
and the gateway use): the session's ``team_id`` while the user is still a member of it, else the
team they last chose in the team switcher (``Membership.last_used_at``, kept across sessions), else
the one they joined last. Views fetch rows only through ``get_scoped`` or ``projects.selectors`` with
``request.team``, so another team's id reads as 404, never as data.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar, cast

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from projects import selectors
from projects.access import DENIED_MESSAGES, Permission, TeamAccess, resolve_team_and_role
from projects.models import Membership, Team

SESSION_TEAM_KEY = "team_id"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

M = TypeVar("M", bound=Model)

TEAM_VIEWS: set[Callable[..., HttpResponse]] = set()  # every team_view, for the URL-walk test


class TeamHttpRequest(HttpRequest):
    """The request a ``team_view`` receives: the caller's access, set before the view runs."""

    access: TeamAccess
    team: Team
    role: str
    memberships: list[Membership]


def session_access(request: HttpRequest) -> TeamAccess | None:
    """The signed-in person's team for this session (see the module docstring)."""
    return resolve_team_and_role(
        user=request.user, preferred_team_id=request.session.get(SESSION_TEAM_KEY), remembered=True
    )


def team_view(*, write: bool = False, owner: bool = False, viewer_may_post: bool = False) -> Callable:
    """Sign-in required; sets ``request.access`` (and its ``team``, ``role``, ``memberships``).

    Reads need ``Permission.READ``; any other method needs ``Permission.WRITE`` (as in the API),
    ``Permission.MANAGE`` with ``owner``, or only READ with ``viewer_may_post`` (choosing a team).
    ``write``: the page itself is for writers (a form viewers cannot use): WRITE for any method.
    """

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @login_required
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            access = session_access(request)
            if access is None:
                return render(request, "frontend/no_team.html")
            team_request = cast(TeamHttpRequest, request)
            team_request.access = access
            team_request.team, team_request.role = access.team, access.role
            team_request.memberships = access.memberships
            needed = [Permission.READ]
            if write:
                needed.append(Permission.WRITE)
            if request.method not in SAFE_METHODS and not viewer_may_post:
                needed.append(Permission.MANAGE if owner else Permission.WRITE)
            for permission in needed:
                if not access.allows(permission):
                    raise PermissionDenied(DENIED_MESSAGES[permission])
            return view(team_request, *args, **kwargs)

        TEAM_VIEWS.add(wrapped)
        return wrapped

    return decorator


def get_scoped(model: type[M], request: TeamHttpRequest, pk: Any, **filters: Any) -> M:
    """The row ``pk`` of ``model`` if it belongs to the current team; 404 otherwise."""
    obj = selectors.scoped(model, request.team).filter(pk=pk, **filters).first()
    if obj is None:
        raise Http404(f"no such {model._meta.verbose_name}")
    return obj


def can_write(request: TeamHttpRequest) -> bool:
    return request.access.allows(Permission.WRITE)
