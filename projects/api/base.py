"""The base of every REST API view: who the caller is, which team, and what the role allows.

Tenancy is enforced here once. ``TeamViewSet`` filters ``get_queryset`` (and so ``get_object``) to
the caller's team through the model's ``TEAM_PATH`` and derives the permission each request needs
from ``projects.access.ROLE_PERMISSIONS``; subclasses cannot override any of that (``__init_subclass__``
refuses), only narrow it (``write_permission = Permission.MANAGE``, ``read_permission`` likewise).
Two deliberate exceptions: ``CatalogueViewSet``, read-only, for operator-maintained rows every team
shares (the base-model catalogue), and ``SignedInViewSet`` for what a signed-in person does before
any team is theirs (accepting an invitation): no team, no queryset, session sign-in only.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db.models import QuerySet
from rest_framework import viewsets
from rest_framework.authentication import SessionAuthentication
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request

from projects import selectors
from projects.access import Permission, TeamAccess
from projects.api.pagination import int_query_param
from projects.api.permissions import TeamPermission, request_access
from projects.errors import ValidationFailed
from projects.models import Team


class CallerViewSet(viewsets.GenericViewSet):
    """Authentication and the role table; the parts no subclass may replace."""

    read_permission: ClassVar[Permission] = Permission.READ
    write_permission: ClassVar[Permission] = Permission.WRITE
    permission_classes = [TeamPermission]
    _final: ClassVar[tuple[str, ...]] = (
        "get_queryset",
        "get_object",
        "permission_classes",
        "get_permissions",
        "check_permissions",
        "check_object_permissions",
        "required_permission",
        "initial",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__:  # the bases below define what they scope
            return
        for name in cls._final:
            if name in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__} must not override {name}: tenancy lives in projects.api.base"
                )
        if cls.write_permission == Permission.READ:
            raise TypeError(f"{cls.__name__}: write_permission may not be weakened to read")

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Query values reach filters as text, and PostgreSQL text cannot hold NUL.
        for name, values in request.query_params.lists():
            if any("\x00" in value for value in values):
                raise ValidationFailed("must not contain NUL characters", field=name)
        super().initial(request, *args, **kwargs)

    def required_permission(self, request: Request) -> Permission:
        return self.read_permission if request.method in SAFE_METHODS else self.write_permission

    @property
    def access(self) -> TeamAccess:
        access = request_access(self.request)
        assert access is not None, "TeamPermission ran first"
        return access

    @property
    def team(self) -> Team:
        return self.access.team

    def paginated(self, queryset: QuerySet, serializer_class: type) -> Any:
        page = self.paginate_queryset(queryset)
        return self.get_paginated_response(serializer_class(page, many=True).data)


class TeamViewSet(CallerViewSet):
    """Base of every team-owned resource and team action: the queryset is always the caller's team's.

    Views without a ``model`` (actions such as ``graders/run``) get no queryset at all.
    """

    model: Any = None  # the Django model; it must define TEAM_PATH

    def base_queryset(self) -> QuerySet:
        return self.model._default_manager.all()

    def get_queryset(self) -> QuerySet:
        if self.model is None:
            raise ImproperlyConfigured(f"{type(self).__name__} has no model to query")
        if getattr(self, "swagger_fake_view", False):  # schema generation has no caller
            return self.model._default_manager.none()
        return self.base_queryset().filter(**{self.model.TEAM_PATH: self.team})

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # authentication, then TeamPermission
        if self.model is not None and (self.lookup_url_kwarg or self.lookup_field) in self.kwargs:
            self.get_object()  # another team's id is a 404 before any body is read

    def get_object(self) -> Any:
        # Through the scoped get_queryset, so another team's id is 404; remembered for the request.
        if not hasattr(self, "_scoped_object"):
            self._scoped_object = super().get_object()
        return self._scoped_object

    def ref(self, model: type, value: Any, field: str) -> Any:
        """A row named by id in the request body; another team's id is a 400 on ``field``."""
        return selectors.scoped_reference(model, self.team, value, field=field)

    def filter_by_project(self, queryset: QuerySet) -> QuerySet:
        project = int_query_param(self.request, "project", None)
        return queryset if project is None else queryset.filter(project_id=project)


class CatalogueViewSet(CallerViewSet):
    """Operator-maintained rows every team may read (any caller with a team); never written here."""

    model: Any = None
    http_method_names = ["get", "head", "options"]

    def get_queryset(self) -> QuerySet:
        return self.model._default_manager.all()


class SignedIn(BasePermission):
    """A person signed in with a session; an API key is no one (keys belong to teams)."""

    message = "Sign in to do this (an API key acts for a team, not for a person)."

    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, User) and request.user.is_authenticated


class SignedInViewSet(viewsets.GenericViewSet):
    """The deliberate exception to team scoping: actions of a signed-in person that no team grants
    yet (accepting an invitation, which is how one joins a team). Session authentication only, no
    ``model`` and no queryset, so it can read or change no team's rows by itself; the service it
    calls decides from what the request carries (an invitation's token). Subclasses cannot replace
    the authentication, the check, or add a queryset."""

    authentication_classes = [SessionAuthentication]
    permission_classes = [SignedIn]
    _final: ClassVar[tuple[str, ...]] = (
        "authentication_classes",
        "permission_classes",
        "get_permissions",
        "get_authenticators",
        "check_permissions",
        "get_queryset",
        "queryset",
        "model",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls._final:
            if name in cls.__dict__:
                raise TypeError(f"{cls.__name__} must not override {name}: see projects.api.base")

    def get_queryset(self) -> QuerySet:
        raise ImproperlyConfigured(f"{type(self).__name__} is not team-scoped and has no queryset")
