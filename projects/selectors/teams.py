"""Reads of teams: their members and API keys, and the teams a person belongs to."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from projects.models import ApiKey, Membership, Team


def api_keys(*, team: Team) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(team=team).order_by("-id")


def memberships_of(*, user: Any) -> QuerySet[Membership]:
    """The teams a signed-in person belongs to, by team name (the dashboard's team switcher)."""
    return Membership.objects.select_related("team").filter(user=user).order_by("team__name")


def team_members(*, team: Team) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(team=team).order_by("user__username")
