"""Team members: the service rules (owners manage; a team keeps at least one owner; nobody is added
without an accepted invitation) and the REST endpoint /api/v1/members/ that exposes them.

The cast (tests/conftest.py): alice owns alpha, bob is a viewer in alpha, charlie owns beta.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from projects import services
from projects.errors import DomainError, Forbidden, NotFound
from projects.models import Membership

pytestmark = pytest.mark.django_db


def _member(team, user):
    return Membership.objects.filter(team=team, user=user).first()


@pytest.fixture
def dora(cast):
    user = get_user_model().objects.create_user("dora", password="pw-dora-123")
    services.membership_set(team=cast.alpha, user=user, role="member")
    return user


# --- service -----------------------------------------------------------------------------------


def test_owner_removes_a_member(cast, dora):
    services.membership_remove(team=cast.alpha, user=dora, by=cast.alice)
    assert _member(cast.alpha, dora) is None


def test_non_owner_cannot_remove_or_change_roles(cast, dora):
    with pytest.raises(Forbidden):
        services.membership_remove(team=cast.alpha, user=cast.bob, by=dora)
    with pytest.raises(Forbidden):
        services.membership_set(team=cast.alpha, user=cast.bob, role="owner", by=cast.bob)
    # An owner of another team is no owner here.
    with pytest.raises(Forbidden):
        services.membership_remove(team=cast.alpha, user=dora, by=cast.charlie)
    assert _member(cast.alpha, cast.bob).role == "viewer" and _member(cast.alpha, dora) is not None


def test_last_owner_cannot_be_removed_or_demoted(cast):
    with pytest.raises(DomainError) as removed:
        services.membership_remove(team=cast.alpha, user=cast.alice, by=cast.alice)
    assert removed.value.code == services.LAST_OWNER and "last owner" in removed.value.message
    for role in ("member", "viewer"):
        with pytest.raises(DomainError) as demoted:
            services.membership_set(team=cast.alpha, user=cast.alice, role=role, by=cast.alice)
        assert demoted.value.code == services.LAST_OWNER
    # Without an acting person (set-up code) the rule still holds.
    with pytest.raises(DomainError):
        services.membership_set(team=cast.alpha, user=cast.alice, role="member")
    assert _member(cast.alpha, cast.alice).role == "owner"


def test_an_owner_may_leave_or_step_down_while_another_owner_remains(cast, dora):
    services.membership_set(team=cast.alpha, user=dora, role="owner", by=cast.alice)
    services.membership_set(team=cast.alpha, user=cast.alice, role="member", by=cast.alice)
    assert _member(cast.alpha, cast.alice).role == "member"
    # Now dora is the only owner: she can remove alice but not herself.
    services.membership_remove(team=cast.alpha, user=cast.alice, by=dora)
    with pytest.raises(DomainError):
        services.membership_remove(team=cast.alpha, user=dora, by=dora)


def test_removing_someone_not_in_the_team_is_not_found(cast):
    with pytest.raises(NotFound):
        services.membership_remove(team=cast.alpha, user=cast.charlie, by=cast.alice)


# --- REST API ----------------------------------------------------------------------------------


def test_members_are_listed_to_any_member(cast, bob_client, dora):
    response = bob_client.get("/api/v1/members/")
    assert response.status_code == 200
    rows = response.json()["data"]
    assert [(r["username"], r["role"]) for r in rows] == [
        ("alice", "owner"),
        ("bob", "viewer"),
        ("dora", "member"),
    ]


def test_owner_changes_and_removes_a_member_over_the_api(cast, alice_client, dora):
    membership_id = _member(cast.alpha, dora).pk
    changed = alice_client.patch(f"/api/v1/members/{membership_id}/", {"role": "viewer"}, format="json")
    assert changed.status_code == 200 and changed.json()["role"] == "viewer"
    response = alice_client.delete(f"/api/v1/members/{membership_id}/")
    assert response.status_code == 204
    assert not Membership.objects.filter(pk=membership_id).exists()


def test_nobody_is_added_directly(cast, alice_client):
    """Joining needs consent (an accepted invitation): the API has no direct add, and the service
    refuses to add anyone on a person's behalf."""
    get_user_model().objects.create_user("erin", password="pw-erin-123")
    for username in ("erin", "nobody"):
        added = alice_client.post("/api/v1/members/", {"username": username, "role": "viewer"}, format="json")
        assert added.status_code == 405, added.content
    erin = get_user_model().objects.get(username="erin")
    with pytest.raises(NotFound):
        services.membership_set(team=cast.alpha, user=erin, role="member", by=cast.alice)
    assert _member(cast.alpha, erin) is None


def test_last_owner_removal_is_400_with_a_reason(cast, alice_client):
    mine = _member(cast.alpha, cast.alice)
    response = alice_client.delete(f"/api/v1/members/{mine.pk}/")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "last_owner" and "last owner" in error["message"]
    demoted = alice_client.patch(f"/api/v1/members/{mine.pk}/", {"role": "viewer"}, format="json")
    assert demoted.status_code == 400 and demoted.json()["error"]["code"] == "last_owner"
    assert _member(cast.alpha, cast.alice).role == "owner"


def test_non_owners_cannot_manage_members(cast, bob_client, key_client, dora):
    target = _member(cast.alpha, dora)
    for client in (bob_client, key_client):  # a viewer; a read-write API key (keys are never owners)
        assert client.delete(f"/api/v1/members/{target.pk}/").status_code == 403
        assert (
            client.patch(f"/api/v1/members/{target.pk}/", {"role": "owner"}, format="json").status_code == 403
        )
        assert (
            client.post("/api/v1/members/", {"username": "bob", "role": "owner"}, format="json").status_code
            == 403
        )
    assert _member(cast.alpha, dora) is not None and _member(cast.alpha, cast.bob).role == "viewer"


def test_another_teams_member_is_not_found(cast, charlie_client, dora):
    target = _member(cast.alpha, dora)
    assert charlie_client.delete(f"/api/v1/members/{target.pk}/").status_code == 404
    assert (
        charlie_client.patch(f"/api/v1/members/{target.pk}/", {"role": "viewer"}, format="json").status_code
        == 404
    )
    assert "dora" not in str(charlie_client.get("/api/v1/members/").json())
    assert _member(cast.alpha, dora).role == "member"
