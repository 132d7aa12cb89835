"""Invitations: the only way into a team is an owner's offer that the invitee accepts (consent).

Nothing here reads the user table before an invitation is accepted: what an owner types is kept as
typed, and creating an invitation answers the same whether or not such a person has an account.
The token is the capability (a link the owner passes on); like an API key only its SHA-256 is
stored. Accepting locks the invitation row (select_for_update), so a token is used once even when
two requests race.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from projects.errors import Conflict, DomainError, NotFound, ValidationFailed
from projects.models import Invitation, Membership, Role, Team
from projects.selectors.teams import invitation_for_token, invitation_token_hash
from projects.services.teams import require_owner

INVITATION_PREFIX = "inv"


@dataclass(frozen=True)
class CreatedInvitation:
    invitation: Invitation
    token: str  # shown once, never stored


def invitation_create(*, team: Team, invitee: str, role: str, by: User | None) -> CreatedInvitation:
    """A pending invitation to ``team`` with ``role`` (owners only, when ``by`` is given), valid for
    ``INVITATION_TTL_HOURS``. ``invitee`` (an email or username) is a label for the owner's list."""
    invitee = invitee.strip()
    if not invitee:
        raise ValidationFailed("must not be empty", field="invitee")
    if len(invitee) > Invitation._meta.get_field("invitee").max_length:  # type: ignore[operator]
        raise ValidationFailed("must be at most 254 characters", field="invitee")
    if role not in Role.values:
        raise ValidationFailed(f"must be one of {', '.join(Role.values)}", field="role")
    require_owner(team=team, by=by)
    prefix = secrets.token_hex(6)
    token = f"{INVITATION_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    invitation = Invitation.objects.create(
        team=team,
        invitee=invitee,
        role=role,
        prefix=prefix,
        token_hash=invitation_token_hash(token),
        created_by=by,
        expires_at=timezone.now() + timedelta(hours=settings.INVITATION_TTL_HOURS),
    )
    return CreatedInvitation(invitation=invitation, token=token)


def invitation_check(invitation: Invitation | None) -> Invitation:
    """The invitation if it can still be accepted; otherwise the error saying why."""
    if invitation is None:
        raise NotFound("no invitation has this token", field="token", code="invitation_not_found")
    if invitation.revoked_at is not None:
        raise DomainError("this invitation was revoked", field="token", code="invitation_revoked")
    if invitation.accepted_at is not None:
        raise DomainError("this invitation was already used", field="token", code="invitation_used")
    if invitation.expires_at <= timezone.now():
        raise DomainError(
            "this invitation has expired: ask a team owner for a new one",
            field="token",
            code="invitation_expired",
        )
    return invitation


def invitation_accept(*, token: str, user: User) -> Membership:
    """``user`` (signed in) joins the invitation's team with its role; the token is spent."""
    with transaction.atomic():
        invitation = invitation_check(invitation_for_token(token=token, lock=True))
        if Membership.objects.filter(team=invitation.team, user=user).exists():
            raise Conflict(
                f"you are already a member of {invitation.team.name}", field="token", code="already_member"
            )
        now = timezone.now()
        try:
            with transaction.atomic():
                membership = Membership.objects.create(
                    team=invitation.team, user=user, role=invitation.role, last_used_at=now
                )
        except IntegrityError as exc:  # joined by another request meanwhile
            raise Conflict(
                f"you are already a member of {invitation.team.name}", field="token", code="already_member"
            ) from exc
        invitation.accepted_at, invitation.accepted_by = now, user
        invitation.save(update_fields=["accepted_at", "accepted_by"])
    return membership


def invitation_revoke(*, invitation: Invitation, by: User | None) -> Invitation:
    """Withdraw a pending invitation (owners only, when ``by`` is given); revoking twice is a no-op.
    An accepted one is a 409: remove the member instead."""
    with transaction.atomic():
        require_owner(team=invitation.team, by=by)
        invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
        if invitation.accepted_at is not None:
            raise Conflict(
                "this invitation was already accepted: remove the member instead", code="invitation_used"
            )
        if invitation.revoked_at is None:
            invitation.revoked_at = timezone.now()
            invitation.save(update_fields=["revoked_at"])
    return invitation
