"""Reads of teams: their members, API keys and pending invitations, and the teams a person
belongs to."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from projects.models import ApiKey, Invitation, Membership, Team


def api_keys(*, team: Team) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(team=team).order_by("-id")


def memberships_of(*, user: Any) -> QuerySet[Membership]:
    """The teams a signed-in person belongs to, by team name (the dashboard's team switcher)."""
    return Membership.objects.select_related("team").filter(user=user).order_by("team__name")


def team_members(*, team: Team) -> QuerySet[Membership]:
    return Membership.objects.select_related("user").filter(team=team).order_by("user__username")


def pending_invitations(*, team: Team) -> QuerySet[Invitation]:
    """Invitations not yet accepted, revoked or expired, newest first (the owners' list)."""
    return Invitation.objects.filter(
        team=team, accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now()
    ).order_by("-id")


def invitation_token_hash(raw: str) -> str:
    # Tokens are 256-bit random strings, so a fast hash is enough (as for API keys).
    return hashlib.sha256(raw.encode()).hexdigest()


def invitation_for_token(*, token: str, lock: bool = False) -> Invitation | None:
    """The invitation whose token is ``token`` (in any state), or None. ``lock``: select_for_update,
    inside the caller's transaction."""
    parts = token.split("_", 2)
    if len(parts) != 3:
        return None
    rows = Invitation.objects.select_related("team")
    if lock:
        rows = rows.select_for_update(of=("self",))
    invitation = rows.filter(prefix=parts[1]).first()
    if invitation is None or not hmac.compare_digest(invitation.token_hash, invitation_token_hash(token)):
        return None
    return invitation
