"""Dashboard views through Django's test client: team scoping, roles, forms.

The cast (tests/conftest.py): alice owns alpha, bob is a viewer in alpha, charlie owns beta.
"""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from projects import services
from projects.models import ApiKey, Run, RunStatus, TaskSet

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    # Creating a run enqueues training after commit; these tests have no worker.
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def alpha_run(alpha_setup, cast):
    return services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
        config={"steps": 2},
        created_by=cast.alice,
    )


def test_signed_out_visitor_is_sent_to_sign_in():
    response = Client().get("/projects/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_sign_in_page_signs_in(cast):
    client = Client()
    assert client.get("/login/").status_code == 200
    response = client.post("/login/", {"username": "alice", "password": "pw-alice-123"})
    assert response.status_code == 302 and response["Location"] == "/projects/"
    assert "alpha" in client.get("/projects/").content.decode()


PAGES = [
    "/runs/{run}/",
    "/runs/{run}/live",
    "/runs/{run}/metrics.json",
    "/runs/{run}/trajectories",
    "/projects/{project}/",
    "/projects/{project}/rewards/",
    "/models/{model}/",
    "/rewards/{reward}/",
]


@pytest.mark.parametrize("page", PAGES)
def test_owner_sees_team_pages(page, cast, alpha_setup, alpha_run):
    url = page.format(
        run=alpha_run.pk,
        project=alpha_setup.project.pk,
        model=alpha_setup.model.pk,
        reward=alpha_setup.reward.pk,
    )
    assert client_for(cast.alice).get(url).status_code == 200


@pytest.mark.parametrize("page", [*PAGES, "/projects/{project}/runs/new"])
def test_other_teams_rows_are_not_found(page, cast, alpha_setup, alpha_run):
    url = page.format(
        run=alpha_run.pk,
        project=alpha_setup.project.pk,
        model=alpha_setup.model.pk,
        reward=alpha_setup.reward.pk,
    )
    assert client_for(cast.charlie).get(url).status_code == 404


def test_other_teams_checkpoint_is_not_found(cast, alpha_setup, alpha_run):
    checkpoint = services.checkpoint_record(model=alpha_setup.model, run=alpha_run, step=0, path="/tmp/none")
    assert client_for(cast.alice).get(f"/checkpoints/{checkpoint.pk}/").status_code == 200
    assert client_for(cast.charlie).get(f"/checkpoints/{checkpoint.pk}/").status_code == 404


def test_lists_show_only_the_current_team(cast, alpha_setup, alpha_run):
    beta_project = services.project_create(team=cast.beta, name="secret-beta")
    html = client_for(cast.alice).get("/projects/").content.decode()
    assert "math" in html and "secret-beta" not in html
    runs_html = client_for(cast.charlie).get("/runs/").content.decode()
    assert f"#{alpha_run.pk}" not in runs_html
    assert beta_project.name in client_for(cast.charlie).get("/projects/").content.decode()


def test_team_switcher_changes_the_current_team(cast, alpha_setup):
    services.membership_set(team=cast.beta, user=cast.alice, role="member")
    services.project_create(team=cast.beta, name="beta-project")
    client = client_for(cast.alice)
    client.post("/team/switch", {"team": cast.beta.pk})
    html = client.get("/projects/").content.decode()
    assert "beta-project" in html and ">math<" not in html
    # A team the user is not in cannot be chosen.
    gamma = services.team_create(name="gamma")
    client.post("/team/switch", {"team": gamma.pk})
    assert "beta-project" in client.get("/projects/").content.decode()


def test_viewer_cannot_cancel_or_create(cast, alpha_setup, alpha_run):
    bob = client_for(cast.bob)
    assert bob.get(f"/runs/{alpha_run.pk}/").status_code == 200
    assert bob.post(f"/runs/{alpha_run.pk}/cancel").status_code == 403
    assert bob.get(f"/projects/{alpha_setup.project.pk}/runs/new").status_code == 403
    assert bob.post(f"/projects/{alpha_setup.project.pk}/runs/new", {}).status_code == 403
    assert bob.post("/projects/", {"name": "nope"}).status_code == 403
    assert bob.post("/team/api-keys", {"name": "nope"}).status_code == 403
    assert bob.post("/team/members", {"invitee": "bob", "role": "owner"}).status_code == 403
    assert Run.objects.get(pk=alpha_run.pk).status == RunStatus.QUEUED


def test_member_cancels_a_queued_run(cast, alpha_run):
    response = client_for(cast.alice).post(f"/runs/{alpha_run.pk}/cancel")
    assert response.status_code == 302
    assert Run.objects.get(pk=alpha_run.pk).status == RunStatus.CANCELLED


def _run_form(setup, **overrides):
    data = {
        "model": setup.model.pk,
        "task_set": setup.task_set.pk,
        "environment": setup.environment.pk,
        "reward": setup.reward.pk,
        "validation_fraction": "0",
    }
    from training.config import TrainConfig

    for name, spec in TrainConfig.field_help().items():
        if spec["default"] is None:
            data[f"hp_{name}"] = ""
        elif spec["type"] == "bool":
            if spec["default"]:
                data[f"hp_{name}"] = "on"
        else:
            data[f"hp_{name}"] = str(spec["default"])
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def test_new_run_form_is_prefilled_with_defaults_and_help(cast, alpha_setup):
    html = client_for(cast.alice).get(f"/projects/{alpha_setup.project.pk}/runs/new").content.decode()
    assert 'name="hp_group_size"' in html and 'value="4"' in html
    assert "Completions sampled per row; advantages compare them." in html


def test_new_run_form_creates_a_run_with_only_changed_hyperparameters(cast, alpha_setup):
    client = client_for(cast.alice)
    response = client.post(
        f"/projects/{alpha_setup.project.pk}/runs/new", _run_form(alpha_setup, hp_steps="3")
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    run = Run.objects.get()
    assert response["Location"] == f"/runs/{run.pk}/"
    assert run.total_steps == 3 and run.created_by == cast.alice


def test_new_run_form_shows_a_service_error_next_to_the_field(cast, alpha_setup):
    response = client_for(cast.alice).post(
        f"/projects/{alpha_setup.project.pk}/runs/new", _run_form(alpha_setup, hp_group_size="1")
    )
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert "hp_group_size" in errors and "at least 2" in errors["hp_group_size"][0]
    assert not Run.objects.exists()


def test_new_run_form_reports_jsonl_errors_per_line(cast, alpha_setup):
    bad = b'{"prompt": "ok", "item": {}}\nnot json\n{"item": {}}\n'
    form = _run_form(alpha_setup, task_set="", task_set_name="uploaded")
    form["task_file"] = SimpleUploadedFile("rows.jsonl", bad)
    response = client_for(cast.alice).post(f"/projects/{alpha_setup.project.pk}/runs/new", form)
    assert response.status_code == 200
    errors = response.context["form"].errors["task_file"]
    assert any(e.startswith("line 2:") and "invalid JSON" in e for e in errors)
    assert any(e.startswith("line 3") and "messages" in e for e in errors)
    assert not TaskSet.objects.filter(name="uploaded").exists()


def test_new_run_form_uploads_a_task_set(cast, alpha_setup):
    rows = b'{"prompt": "a", "item": {"answer": "a"}}\n{"prompt": "b", "item": {"answer": "b"}}\n'
    form = _run_form(alpha_setup, task_set="", task_set_name="uploaded")
    form["task_file"] = SimpleUploadedFile("rows.jsonl", rows)
    response = client_for(cast.alice).post(f"/projects/{alpha_setup.project.pk}/runs/new", form)
    assert response.status_code == 302
    assert Run.objects.get().task_set.name == "uploaded"


def test_new_run_form_refuses_another_teams_inputs(cast, alpha_setup):
    beta_project = services.project_create(team=cast.beta, name="b")
    beta_reward = services.reward_definition_create(
        project=beta_project, name="r", spec={"type": "regex", "pattern": "a"}
    )
    response = client_for(cast.alice).post(
        f"/projects/{alpha_setup.project.pk}/runs/new", _run_form(alpha_setup, reward=beta_reward.pk)
    )
    assert response.status_code == 200 and "reward" in response.context["form"].errors
    assert not Run.objects.exists()


def test_api_key_is_shown_once_and_revoked(cast):
    client = client_for(cast.alice)
    html = client.post("/team/api-keys", {"name": "ci"}).content.decode()
    key = ApiKey.objects.get(name="ci")
    assert f"aw_{key.prefix}_" in html and "shown only this once" in html
    assert "shown only this once" not in client.get("/team/api-keys").content.decode()
    client.post(f"/team/api-keys/{key.pk}/revoke")
    key.refresh_from_db()
    assert key.revoked_at is not None
    other = services.api_key_create(team=cast.beta, name="theirs").api_key
    assert client.post(f"/team/api-keys/{other.pk}/revoke").status_code == 404


def test_owner_invites_from_the_members_page_and_the_invitee_accepts(cast):
    from django.contrib.auth import get_user_model

    from projects.models import Invitation, Membership

    dora = get_user_model().objects.create_user("dora", password="pw-dora-123")
    client = client_for(cast.alice)
    html = client.post("/team/members", {"invitee": "dora", "role": "member"}).content.decode()
    invitation = Invitation.objects.get()
    assert "shown only this once" in html and 'data-copy="accept-link"' in html
    link = html.split('<code id="accept-link">')[1].split("</code>")[0].replace("&amp;", "&")
    assert link.startswith("http://testserver/invitations/accept?token=inv_")
    assert not Membership.objects.filter(team=cast.alpha, user=dora).exists()
    listed = client.get("/team/members").content.decode()
    assert 'data-invitation="dora"' in listed and "shown only this once" not in listed
    # Inviting a name nobody has reads exactly the same.
    unknown = client.post("/team/members", {"invitee": "nobody", "role": "member"}).content.decode()
    assert "shown only this once" in unknown and "no user" not in unknown

    invitee = client_for(dora)
    page = invitee.get(link.removeprefix("http://testserver"))
    assert page.status_code == 200
    assert "Join alpha" in page.content.decode() and "member" in page.content.decode()
    token = link.split("token=")[1]
    joined = invitee.post("/invitations/accept", {"token": token})
    assert joined.status_code == 302 and joined["Location"] == "/projects/"
    assert Membership.objects.get(team=cast.alpha, user=dora).role == "member"
    invitation.refresh_from_db()
    assert invitation.accepted_by == dora
    used = invitee.get(f"/invitations/accept?token={token}")
    assert used.status_code == 400 and "already used" in used.content.decode()


def test_the_accept_page_needs_sign_in_and_refuses_bad_tokens(cast):
    created = services.invitation_create(team=cast.alpha, invitee="dora", role="viewer", by=cast.alice)
    anonymous = Client().get(f"/invitations/accept?token={created.token}")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/?next=")
    charlie = client_for(cast.charlie)
    assert charlie.get("/invitations/accept?token=inv_nope_nope").status_code == 404
    services.invitation_revoke(invitation=created.invitation, by=cast.alice)
    revoked = charlie.post("/invitations/accept", {"token": created.token})
    assert revoked.status_code == 400 and "revoked" in revoked.content.decode()


def test_owner_revokes_a_pending_invitation(cast):
    from projects.models import Invitation

    created = services.invitation_create(team=cast.alpha, invitee="dora", role="member", by=cast.alice)
    client = client_for(cast.alice)
    html = client.get("/team/members").content.decode()
    assert f'action="/team/invitations/{created.invitation.pk}/revoke"' in html
    response = client.post(f"/team/invitations/{created.invitation.pk}/revoke", follow=True)
    assert "The invitation for dora was revoked." in response.content.decode()
    assert Invitation.objects.get().revoked_at is not None
    assert 'data-invitation="dora"' not in client.get("/team/members").content.decode()
    theirs = services.invitation_create(team=cast.beta, invitee="x", role="member", by=cast.charlie)
    assert client.post(f"/team/invitations/{theirs.invitation.pk}/revoke").status_code == 404
    assert client_for(cast.bob).post(f"/team/invitations/{created.invitation.pk}/revoke").status_code == 403


def test_owner_changes_a_role_from_the_members_page(cast):
    from projects.models import Membership

    bob = Membership.objects.get(team=cast.alpha, user=cast.bob)
    response = client_for(cast.alice).post(f"/team/members/{bob.pk}/role", {"role": "member"}, follow=True)
    assert "bob is now member." in response.content.decode()
    assert Membership.objects.get(pk=bob.pk).role == "member"
    assert client_for(cast.bob).post(f"/team/members/{bob.pk}/role", {"role": "owner"}).status_code == 403


def test_the_dashboard_remembers_the_team_last_chosen_across_sessions(cast):
    from django.contrib.auth import get_user_model

    erin = get_user_model().objects.create_user("erin", password="pw-erin-123")
    services.membership_set(team=cast.alpha, user=erin, role="member")
    services.membership_set(team=cast.beta, user=erin, role="member")
    services.project_create(team=cast.alpha, name="alpha-project")
    services.project_create(team=cast.beta, name="beta-project")
    # None chosen yet: the team joined last (beta), not the alphabetically first.
    assert "beta-project" in client_for(erin).get("/projects/").content.decode()
    client_for(erin).post("/team/switch", {"team": cast.alpha.pk})
    html = client_for(erin).get("/projects/").content.decode()  # a new session
    assert "alpha-project" in html and "beta-project" not in html


def test_owner_removes_a_member_from_the_members_page(cast):
    from projects.models import Membership

    bob = Membership.objects.get(team=cast.alpha, user=cast.bob)
    client = client_for(cast.alice)
    html = client.get("/team/members").content.decode()
    assert f'action="/team/members/{bob.pk}/remove"' in html and "data-confirm=" in html
    response = client.post(f"/team/members/{bob.pk}/remove", follow=True)
    assert "bob was removed from the team." in response.content.decode()
    assert not Membership.objects.filter(pk=bob.pk).exists()


def test_members_page_refuses_to_remove_or_demote_the_last_owner(cast):
    from projects.models import Membership

    alice = Membership.objects.get(team=cast.alpha, user=cast.alice)
    client = client_for(cast.alice)
    html = client.post(f"/team/members/{alice.pk}/remove", follow=True).content.decode()
    assert "last owner" in html
    html = client.post(f"/team/members/{alice.pk}/role", {"role": "viewer"}, follow=True).content.decode()
    assert "last owner" in html
    assert Membership.objects.get(pk=alice.pk).role == "owner"


def test_only_owners_see_or_use_the_remove_button(cast):
    from projects.models import Membership

    charlie_in_alpha = services.membership_set(team=cast.alpha, user=cast.charlie, role="member")
    bob = client_for(cast.bob)
    assert "/remove" not in bob.get("/team/members").content.decode()
    assert bob.post(f"/team/members/{charlie_in_alpha.pk}/remove").status_code == 403
    # Another team's membership is not found, even for an owner (charlie owns beta, not alpha).
    alpha_owner = Membership.objects.get(team=cast.alpha, user=cast.alice)
    charlie = client_for(cast.charlie)
    charlie.post("/team/switch", {"team": cast.beta.pk})
    assert charlie.post(f"/team/members/{alpha_owner.pk}/remove").status_code == 404
    assert Membership.objects.filter(pk__in=[charlie_in_alpha.pk, alpha_owner.pk]).count() == 2


def test_owner_leaving_the_team_goes_back_to_projects(cast):
    from projects.models import Membership

    services.membership_set(team=cast.alpha, user=cast.charlie, role="owner")
    client = client_for(cast.charlie)
    client.post("/team/switch", {"team": cast.alpha.pk})
    mine = Membership.objects.get(team=cast.alpha, user=cast.charlie)
    response = client.post(f"/team/members/{mine.pk}/remove")
    assert response.status_code == 302 and response["Location"] == "/projects/"
    assert not Membership.objects.filter(pk=mine.pk).exists()
    assert "beta" in client.get("/projects/").content.decode()


def test_reward_editor_saves_a_new_version_and_shows_errors(cast, alpha_setup):
    client = client_for(cast.alice)
    url = f"/rewards/{alpha_setup.reward.pk}/"
    response = client.post(url, {"spec": '{"type": "regex"}'})
    assert response.status_code == 200 and response.context["form"].errors["spec"]
    response = client.post(url, {"spec": "{not json"})
    assert "not valid JSON" in response.context["form"].errors["spec"][0]
    response = client.post(url, {"spec": '{"type": "regex", "pattern": "4"}'})
    assert response.status_code == 302
    html = client.get(response["Location"]).content.decode()
    assert "v2" in html and "Saved as version 2" in html


def test_environment_form_offers_every_kind_and_marks_unavailable(cast, alpha_setup):
    from projects.models import EnvironmentKind

    html = client_for(cast.alice).get(f"/projects/{alpha_setup.project.pk}/").content.decode()
    for kind in EnvironmentKind:
        assert f'value="{kind.value}"' in html


def test_run_metrics_json_has_the_chart_series(cast, alpha_setup, alpha_run):
    # A GRPO run's series: no SFT/DPO held-out panels (tests/frontend/test_run_charts_by_kind.py).
    data = client_for(cast.alice).get(f"/runs/{alpha_run.pk}/metrics.json").json()
    assert data["steps"] == []
    assert set(data["series"]) == {
        "loss", "grad_norm", "completion_tokens", "kl", "entropy", "clip_fraction",
        "zero_variance_fraction", "tokens_per_second", "ratio_std", "learning_rate", "groups_dropped",
        "off_policy_steps",
    }  # fmt: skip
    assert data["sub_rewards"] == {}
    assert data["validation"] == {"steps": [], "reward_mean": [], "evaluated": []}


def test_playground_needs_a_signed_in_member(cast):
    response = Client().post("/playground/chat", b"{}", content_type="application/json")
    assert response.status_code == 401


def test_environment_form_creates_and_reports_errors(cast, alpha_setup):
    client = client_for(cast.alice)
    url = f"/projects/{alpha_setup.project.pk}/"
    response = client.post(
        url, {"environment-name": "bad", "environment-kind": "chat", "environment-max_turns": "3"}
    )
    assert response.status_code == 200 and response.context["environment_form"].errors
    response = client.post(url, {"environment-name": "plain", "environment-kind": "chat"})
    assert response.status_code == 302
    assert alpha_setup.project.environments.filter(name="plain").exists()


def test_grader_validation_as_you_type_answers_problems_with_200(cast):
    client = client_for(cast.alice)
    ok = client.post(
        "/rewards/validate", {"grader": {"type": "regex", "pattern": "a"}}, content_type="application/json"
    )
    assert ok.status_code == 200 and ok.json()["valid"] is True
    bad = client.post("/rewards/validate", {"grader": {"type": "regex"}}, content_type="application/json")
    assert bad.status_code == 200 and bad.json()["valid"] is False
    assert any("pattern" in problem for problem in bad.json()["problems"])


def test_run_and_checkpoint_pages_show_evaluations(cast, alpha_setup, alpha_run):
    from projects.models import Evaluation

    checkpoint = services.checkpoint_record(model=alpha_setup.model, run=alpha_run, step=1, path="/tmp/none")
    client = client_for(cast.alice)
    assert "No evaluations for this run." in client.get(f"/runs/{alpha_run.pk}/").content.decode()
    assert (
        "No evaluations of this checkpoint." in client.get(f"/checkpoints/{checkpoint.pk}/").content.decode()
    )
    Evaluation.objects.create(
        project=alpha_setup.project, run=alpha_run, step=1, checkpoint=checkpoint,
        task_set=alpha_setup.task_set, environment=alpha_setup.environment, reward=alpha_setup.reward,
        status="succeeded", results={"n": 4, "reward_mean": 0.625, "pass_rate": 0.5, "comparison": {"win_rate": 0.75}},
    )  # fmt: skip
    for url in (f"/runs/{alpha_run.pk}/", f"/checkpoints/{checkpoint.pk}/"):
        html = client.get(url).content.decode()
        assert "0.625" in html and "0.500" in html and "0.750" in html
    # A run's own later evaluation compares with its step-0 baseline (projects.services.evaluations).
    Evaluation.objects.create(
        project=alpha_setup.project, run=alpha_run, step=2, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward, status="succeeded",
        results={"n": 4, "reward_mean": 0.25, "baseline_step": 0, "comparison_to_baseline": {"win_rate": 0.375}},
    )  # fmt: skip
    html = client.get(f"/runs/{alpha_run.pk}/").content.decode()
    assert '0.375 <span class="muted">vs step 0</span>' in html


def test_runs_list_filters_searches_and_paginates(cast, alpha_setup, alpha_run):
    from projects.models import Run as RunModel

    services.run_cancel(run=alpha_run)
    for _ in range(25):  # rows straight in the table: the list only reads them
        RunModel.objects.create(
            project=alpha_setup.project, model=alpha_setup.model, task_set=alpha_setup.task_set,
            environment=alpha_setup.environment, reward=alpha_setup.reward, config={}, total_steps=1,
            status="succeeded",
        )  # fmt: skip
    client = client_for(cast.alice)
    page_one = client.get("/runs/?status=succeeded").context["page"]
    assert page_one.paginator.count == 25 and len(page_one.object_list) == 20
    html = client.get("/runs/?status=succeeded&page=2").content.decode()
    assert "Page 2 of 2" in html and "status=succeeded&amp;page=1" in html
    assert client.get("/runs/?status=cancelled").context["page"].paginator.count == 1
    assert client.get("/runs/?q=agent").context["page"].paginator.count == 26
    assert client.get("/runs/?q=nothing-like-this").context["page"].paginator.count == 0


def _trajectory(run, sample_index, reward, answer, errors=()):
    from projects.models import Trajectory

    messages = [
        {"role": "user", "content": "What is 6*7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": answer},
    ]
    return Trajectory.objects.create(
        run=run, step=1, group_index=0, sample_index=sample_index, messages=messages, reward=reward,
        sub_rewards={"exact": reward}, errors=list(errors),
    )  # fmt: skip


def test_trajectory_viewer_orders_by_reward_renders_tools_and_marks_the_divergence(cast, alpha_run):
    _trajectory(
        alpha_run,
        0,
        0.0,
        "The answer is 41",
        errors=[{"code": "timeout", "detail": "slow", "grader": "exact"}],
    )
    _trajectory(alpha_run, 1, 1.0, "The answer is 42")
    _trajectory(alpha_run, 2, 0.5, "The answer is 42!")
    response = client_for(cast.alice).get(f"/runs/{alpha_run.pk}/trajectories?step=1&group=0")
    columns = response.context["columns"]
    assert [c.trajectory.reward for c in columns] == [1.0, 0.5, 0.0]
    assert [c.rank for c in columns] == ["best", "", "worst"]
    best_answer = columns[0].messages[3]
    assert best_answer.first_divergence
    assert [(p.text, p.diverged) for p in best_answer.parts] == [("The answer is 4", False), ("2", True)]
    assert not any(p.diverged for m in columns[1].messages for p in m.parts)  # only best and worst
    html = response.content.decode()
    assert "→ calculator" in html and "&quot;expression&quot;: &quot;6*7&quot;" in html
    assert "result of call_1" in html and "timeout" in html and "diverges here" in html


def test_viewer_sees_why_a_write_is_refused(cast, alpha_run, settings):
    settings.DEBUG = False
    response = client_for(cast.bob).post(f"/runs/{alpha_run.pk}/cancel")
    assert response.status_code == 403 and "Viewers have read-only access" in response.content.decode()


def test_a_user_in_no_team_is_told_so(db):
    from django.contrib.auth import get_user_model

    loner = get_user_model().objects.create_user("loner", password="pw-loner-123")
    assert "You are in no team yet" in client_for(loner).get("/projects/").content.decode()


def test_run_page_shows_the_newest_events_first(cast, alpha_run):
    for i in range(60):
        services.run_event_add(run=alpha_run, message=f"event number {i}")
    html = client_for(cast.alice).get(f"/runs/{alpha_run.pk}/live").content.decode()
    assert "event number 59" in html and "event number 5<" not in html
    assert html.index("event number 59") < html.index("event number 58")
