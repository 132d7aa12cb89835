"""A session's team is explicit (projects.access.resolve_team_and_role): the REST API refuses to
guess between a person's teams (400 naming X-Team); the dashboard takes the team they last chose,
else the one they joined last; never the alphabetically first.

The cast (tests/conftest.py): alice owns alpha, bob is a viewer in alpha, charlie owns beta.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from projects import services
from projects.access import TeamNotChosen, resolve_team_and_role
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_in_two_teams(cast):
    services.membership_set(team=cast.beta, user=cast.alice, role="member")
    services.project_create(team=cast.beta, name="beta-project")
    return cast


def test_a_session_call_with_two_teams_and_no_x_team_is_400_naming_it(alice_in_two_teams, alice_client):
    response = alice_client.get("/api/v1/projects/")
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "X-Team" and error["type"] == "invalid_request_error"
    assert error["code"] == "team_required"
    assert "alpha" in error["message"] and "beta" in error["message"]
    # Writes too: nothing lands in a team the caller did not name.
    created = alice_client.post("/api/v1/projects/", {"name": "where"}, format="json")
    assert created.status_code == 400 and error_of(created)["param"] == "X-Team"


def test_naming_the_team_works_by_header_or_query(alice_in_two_teams, alice_client):
    beta = alice_client.get("/api/v1/projects/", HTTP_X_TEAM="beta")
    assert beta.status_code == 200 and [p["name"] for p in beta.json()["data"]] == ["beta-project"]
    alpha = alice_client.get("/api/v1/projects/?team=alpha")
    assert alpha.status_code == 200 and "beta-project" not in alpha.content.decode()
    # A team the caller is not in is no team of theirs.
    assert alice_client.get("/api/v1/projects/", HTTP_X_TEAM="gamma").status_code == 403


def test_one_team_needs_no_x_team(cast, alice_client, charlie_client):
    assert alice_client.get("/api/v1/projects/").status_code == 200
    assert charlie_client.get("/api/v1/projects/").status_code == 200


def test_an_api_key_needs_no_x_team(alice_in_two_teams, key_client):
    assert key_client.get("/api/v1/projects/").status_code == 200


def test_the_resolver_never_falls_back_to_name_order(cast):
    erin = get_user_model().objects.create_user("erin", password="pw-erin-123")
    services.membership_set(team=cast.alpha, user=erin, role="viewer")
    services.membership_set(team=cast.beta, user=erin, role="member")  # joined last
    with pytest.raises(TeamNotChosen):
        resolve_team_and_role(user=erin)
    access = resolve_team_and_role(user=erin, remembered=True)
    assert access is not None and access.team == cast.beta  # the newest membership, not "alpha"
    services.team_choose(user=erin, team=cast.alpha)
    access = resolve_team_and_role(user=erin, remembered=True)
    assert access is not None and access.team == cast.alpha and access.role == "viewer"
    # The session's own choice wins while the person is still a member of it.
    access = resolve_team_and_role(user=erin, preferred_team_id=cast.beta.pk, remembered=True)
    assert access is not None and access.team == cast.beta
    assert [m.team.name for m in access.memberships] == ["alpha", "beta"]  # the switcher's order
