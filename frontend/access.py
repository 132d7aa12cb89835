"""Who is asking, for which team: every dashboard view is wrapped in ``team_view``.

Tenancy is enforced here once: the current team is the session's ``team_id`` while the user is
still a member of it (else their first team), and views fetch rows only through ``get_scoped`` or
``projects.selectors`` with ``request.team``, so another team's id reads as 404, never as data.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from projects import selectors
from projects.models import Membership, Role

SESSION_TEAM_KEY = "team_id"

M = TypeVar("M", bound=Model)


def current_membership(request: HttpRequest) -> tuple[Membership | None, list[Membership]]:
    memberships = list(selectors.memberships_of(user=request.user))
    wanted = request.session.get(SESSION_TEAM_KEY)
    chosen = next((m for m in memberships if m.team_id == wanted), memberships[0] if memberships else None)
    return chosen, memberships


def team_view(*, write: bool = False, owner: bool = False) -> Callable:
    """Sign-in required; sets ``request.team``, ``request.role`` and ``request.memberships``.

    ``write``: viewers get 403 (any method). ``owner``: only owners may POST (others may read).
    """

    def decorator(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @login_required
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            membership, memberships = current_membership(request)
            if membership is None:
                return render(request, "frontend/no_team.html")
            request.team = membership.team  # type: ignore[attr-defined]
            request.role = membership.role  # type: ignore[attr-defined]
            request.memberships = memberships  # type: ignore[attr-defined]
            if write and membership.role == Role.VIEWER:
                raise PermissionDenied("Viewers have read-only access to this team.")
            if owner and request.method == "POST" and membership.role != Role.OWNER:
                raise PermissionDenied("Only team owners can do this.")
            return view(request, *args, **kwargs)

        return wrapped

    return decorator


def get_scoped(model: type[M], request: HttpRequest, pk: Any, **filters: Any) -> M:
    """The row ``pk`` of ``model`` if it belongs to the current team; 404 otherwise."""
    obj = selectors.scoped(model, request.team).filter(pk=pk, **filters).first()  # type: ignore[attr-defined]
    if obj is None:
        raise Http404(f"no such {model._meta.verbose_name}")
    return obj


def can_write(request: HttpRequest) -> bool:
    return getattr(request, "role", None) in (Role.OWNER, Role.MEMBER)
