"""Joining a team needs consent: owners invite, the invitee accepts with the token.

The cast (tests/conftest.py): alice owns alpha, bob is a viewer in alpha, charlie owns beta.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from projects import services
from projects.errors import Forbidden
from projects.models import Invitation, Membership
from tests.conftest import _client, error_of

pytestmark = pytest.mark.django_db

ACCEPT = "/api/v1/invitations/accept"


@pytest.fixture
def dora(cast):
    return get_user_model().objects.create_user("dora", password="pw-dora-123")


@pytest.fixture
def dora_client(dora):
    return _client(dora)


def _invite(client, invitee: str = "dora", role: str = "member"):
    return client.post("/api/v1/invitations/", {"invitee": invitee, "role": role}, format="json")


def _comparable(body: dict) -> dict:
    """A create response without what differs between any two invitations."""
    varying = {"id", "token", "accept_url", "invitee", "created_at", "expires_at"}
    return {key: value for key, value in body.items() if key not in varying}


def test_owner_invites_and_the_invitee_accepts_with_the_role(cast, alice_client, dora, dora_client):
    created = _invite(alice_client, role="viewer")
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["token"].startswith("inv_") and body["role"] == "viewer" and body["created_by"] == "alice"
    assert body["accept_url"].endswith(f"/invitations/accept?token={body['token']}")
    assert Membership.objects.filter(team=cast.alpha, user=dora).count() == 0  # not before consent
    listed = alice_client.get("/api/v1/invitations/").json()
    assert [row["invitee"] for row in listed["data"]] == ["dora"] and "token" not in listed["data"][0]

    accepted = dora_client.post(ACCEPT, {"token": body["token"]}, format="json")
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["team"] == "alpha" and accepted.json()["role"] == "viewer"
    assert Membership.objects.get(team=cast.alpha, user=dora).role == "viewer"
    invitation = Invitation.objects.get()
    assert invitation.accepted_by == dora and invitation.accepted_at is not None
    assert alice_client.get("/api/v1/invitations/").json()["data"] == []  # no longer pending


def test_responses_are_the_same_for_an_existing_and_a_missing_username(cast, alice_client, dora):
    existing, missing = _invite(alice_client, "dora"), _invite(alice_client, "no-such-person")
    assert existing.status_code == missing.status_code == 201
    assert _comparable(existing.json()) == _comparable(missing.json())
    assert existing.json().keys() == missing.json().keys()
    assert existing.headers.get("Content-Type") == missing.headers.get("Content-Type")
    email = _invite(alice_client, "someone@example.com")
    assert email.status_code == 201 and _comparable(email.json()) == _comparable(existing.json())


def test_token_is_stored_hashed(alice_client):
    token = _invite(alice_client).json()["token"]
    invitation = Invitation.objects.get()
    assert invitation.token_hash == hashlib.sha256(token.encode()).hexdigest()
    stored = " ".join(str(value) for value in Invitation.objects.values().get().values())
    secret = token.split("_", 2)[2]  # inv_<prefix>_<secret>; the url-safe secret may itself hold "_"
    assert len(secret) >= 40 and token not in stored and secret not in stored


def test_token_is_single_use(cast, alice_client, dora_client):
    token = _invite(alice_client).json()["token"]
    assert dora_client.post(ACCEPT, {"token": token}, format="json").status_code == 201
    again = _client(cast.charlie).post(ACCEPT, {"token": token}, format="json")
    assert again.status_code == 400 and error_of(again)["code"] == "invitation_used"
    assert not Membership.objects.filter(team=cast.alpha, user=cast.charlie).exists()


def test_expired_token_is_refused(cast, alice_client, dora, dora_client, settings):
    settings.INVITATION_TTL_HOURS = 1
    token = _invite(alice_client).json()["token"]
    invitation = Invitation.objects.get()
    assert invitation.expires_at - invitation.created_at == pytest.approx(
        timedelta(hours=1), abs=timedelta(seconds=5)
    )
    Invitation.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    refused = dora_client.post(ACCEPT, {"token": token}, format="json")
    assert refused.status_code == 400 and error_of(refused)["code"] == "invitation_expired"
    assert error_of(refused)["param"] == "token"
    assert not Membership.objects.filter(team=cast.alpha, user=dora).exists()
    assert alice_client.get("/api/v1/invitations/").json()["data"] == []


def test_revoked_token_is_refused(cast, alice_client, dora, dora_client):
    token = _invite(alice_client).json()["token"]
    invitation_id = Invitation.objects.get().pk
    assert alice_client.delete(f"/api/v1/invitations/{invitation_id}/").status_code == 204
    assert alice_client.delete(f"/api/v1/invitations/{invitation_id}/").status_code == 204  # idempotent
    refused = dora_client.post(ACCEPT, {"token": token}, format="json")
    assert refused.status_code == 400 and error_of(refused)["code"] == "invitation_revoked"
    assert not Membership.objects.filter(team=cast.alpha, user=dora).exists()


def test_unknown_or_malformed_tokens_are_not_found(dora_client, alice_client):
    token = _invite(alice_client).json()["token"]
    for wrong in (token[:-2] + "xx", "inv_nope_nope", "garbage"):
        refused = dora_client.post(ACCEPT, {"token": wrong}, format="json")
        assert refused.status_code == 404 and error_of(refused)["code"] == "invitation_not_found", wrong
    missing = dora_client.post(ACCEPT, {}, format="json")
    assert missing.status_code == 400 and error_of(missing)["param"] == "token"


def test_an_accepted_invitation_cannot_be_revoked(alice_client, dora_client):
    token = _invite(alice_client).json()["token"]
    dora_client.post(ACCEPT, {"token": token}, format="json")
    refused = alice_client.delete(f"/api/v1/invitations/{Invitation.objects.get().pk}/")
    assert refused.status_code == 409


def test_a_member_accepting_again_is_a_conflict_and_keeps_the_token(cast, alice_client):
    token = _invite(alice_client, "bob", role="owner").json()["token"]
    refused = _client(cast.bob).post(ACCEPT, {"token": token}, format="json")
    assert refused.status_code == 409 and error_of(refused)["code"] == "already_member"
    assert Membership.objects.get(team=cast.alpha, user=cast.bob).role == "viewer"
    assert Invitation.objects.get().accepted_at is None


def test_only_owners_see_create_and_revoke_invitations(
    cast, alice_client, bob_client, key_client, read_only_client
):
    _invite(alice_client)
    invitation_id = Invitation.objects.get().pk
    for client in (bob_client, key_client, read_only_client):  # a viewer; keys are never owners
        assert _invite(client).status_code == 403
        assert client.get("/api/v1/invitations/").status_code == 403
        assert client.delete(f"/api/v1/invitations/{invitation_id}/").status_code == 403
    assert Invitation.objects.count() == 1 and Invitation.objects.get().revoked_at is None


def test_an_outsider_cannot_see_or_revoke_another_teams_invitation(cast, alice_client, charlie_client):
    _invite(alice_client)
    invitation = Invitation.objects.get()
    assert charlie_client.delete(f"/api/v1/invitations/{invitation.pk}/").status_code == 404
    assert charlie_client.get("/api/v1/invitations/").json()["data"] == []
    invitation.refresh_from_db()
    assert invitation.revoked_at is None


def test_accepting_needs_a_signed_in_person(alice_client, alpha_key, anonymous_client):
    token = _invite(alice_client).json()["token"]
    assert anonymous_client.post(ACCEPT, {"token": token}, format="json").status_code == 403
    # An API key is a team's, not a person's: it cannot accept on anyone's behalf.
    assert _client(key=alpha_key).post(ACCEPT, {"token": token}, format="json").status_code == 403
    assert Invitation.objects.get().accepted_at is None


def test_invitation_rules_in_the_service(cast, dora):
    with pytest.raises(Forbidden):
        services.invitation_create(team=cast.alpha, invitee="dora", role="member", by=cast.bob)
    created = services.invitation_create(team=cast.alpha, invitee="  dora  ", role="owner", by=cast.alice)
    assert created.invitation.invitee == "dora"
    membership = services.invitation_accept(token=created.token, user=dora)
    assert membership.role == "owner" and membership.last_used_at is not None
