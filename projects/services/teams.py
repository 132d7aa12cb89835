"""Teams, their members and their API keys.

A team always keeps at least one owner: demoting or removing one first locks the team's owner
memberships (select_for_update), so two owners leaving at once are serialised and the second
sees that it would be the last.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from projects.errors import DomainError, Forbidden, NotFound, ValidationFailed
from projects.models import ApiKey, Membership, Role, Team
from projects.services._common import check_slug, create_unique


def team_create(*, name: str, owner: User | None = None) -> Team:
    check_slug(name, "name")
    if Team.objects.filter(name=name).exists():
        raise ValidationFailed(f"a team named {name!r} already exists", field="name")
    with transaction.atomic():
        team = create_unique(lambda: Team.objects.create(name=name), field="name", message="team name taken")
        if owner is not None:
            Membership.objects.create(team=team, user=owner, role=Role.OWNER)
    return team


# The error code of a refused demotion or removal of a team's last owner.
LAST_OWNER = "last_owner"


def require_owner(*, team: Team, by: User | None) -> None:
    """``by`` is the person acting; None means the platform itself (set-up commands, tests)."""
    if by is not None and not Membership.objects.filter(team=team, user=by, role=Role.OWNER).exists():
        raise Forbidden("only team owners manage members")


def _refuse_last_owner(*, team: Team, user: User, action: str) -> None:
    owners = list(
        Membership.objects.select_for_update()
        .filter(team=team, role=Role.OWNER)
        .values_list("user_id", flat=True)
    )
    if owners == [user.pk]:
        raise DomainError(
            f"{user.username} is the last owner of {team.name} and cannot be {action}; "
            "make another member an owner first",
            field="user",
            code=LAST_OWNER,
        )


def membership_set(*, team: Team, user: User, role: str, by: User | None = None) -> Membership:
    """Change ``user``'s role in ``team`` (owners only, when ``by`` is given). A person acting
    (``by``) never adds anyone: people join by accepting an invitation (services.invitations);
    only the platform itself (``by=None``: set-up commands, tests) may add a member directly.
    The last owner cannot be demoted."""
    if role not in Role.values:
        raise ValidationFailed(f"must be one of {', '.join(Role.values)}", field="role")
    with transaction.atomic():
        require_owner(team=team, by=by)
        if by is not None and not Membership.objects.filter(team=team, user=user).exists():
            raise NotFound(
                f"{user.username} is not a member of {team.name}: invite them instead", field="user"
            )
        if role != Role.OWNER:
            _refuse_last_owner(team=team, user=user, action="demoted")
        membership, _ = Membership.objects.update_or_create(team=team, user=user, defaults={"role": role})
    return membership


def membership_remove(*, team: Team, user: User, by: User | None) -> None:
    """Take ``user`` out of ``team`` (owners only, when ``by`` is given; an owner may remove
    themselves while another owner remains). The last owner cannot be removed."""
    with transaction.atomic():
        require_owner(team=team, by=by)
        membership = Membership.objects.select_for_update().filter(team=team, user=user).first()
        if membership is None:
            raise NotFound(f"{user.username} is not a member of {team.name}", field="user")
        if membership.role == Role.OWNER:
            _refuse_last_owner(team=team, user=user, action="removed")
        membership.delete()


def team_choose(*, user: User, team: Team) -> Membership:
    """Remember ``team`` as the one ``user`` works in (the dashboard's team switcher, accepting an
    invitation): the fallback when a session has not chosen (``projects.access``)."""
    membership = Membership.objects.filter(team=team, user=user).first()
    if membership is None:
        raise NotFound(f"you are not a member of {team.name}", field="team")
    membership.last_used_at = timezone.now()
    membership.save(update_fields=["last_used_at"])
    return membership


API_KEY_PREFIX = "aw"


def _hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class CreatedApiKey:
    api_key: ApiKey
    plaintext: str  # shown once, never stored


def api_key_create(
    *, team: Team, name: str, read_only: bool = False, created_by: User | None = None
) -> CreatedApiKey:
    if not name.strip():
        raise ValidationFailed("must not be empty", field="name")
    prefix = secrets.token_hex(6)
    plaintext = f"{API_KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    api_key = ApiKey.objects.create(
        team=team,
        name=name.strip()[:100],
        prefix=prefix,
        key_hash=_hash_key(plaintext),
        read_only=read_only,
        created_by=created_by,
    )
    return CreatedApiKey(api_key=api_key, plaintext=plaintext)


_LAST_USED_RESOLUTION = timedelta(seconds=60)


def api_key_authenticate(*, raw: str) -> ApiKey | None:
    """Return the active key matching ``raw`` or None. Updates ``last_used_at`` at most once a
    minute so authentication does not write on every request."""
    parts = raw.split("_", 2)
    if len(parts) != 3 or parts[0] != API_KEY_PREFIX:
        return None
    api_key = ApiKey.objects.select_related("team").filter(prefix=parts[1], revoked_at__isnull=True).first()
    if api_key is None or not hmac.compare_digest(api_key.key_hash, _hash_key(raw)):
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > _LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now
    return api_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key
