"""Dashboard pages of the team and its projects. Each view: resolve the team (``team_view``), read
through projects.selectors, write through projects.services, render a template. Domain errors go
back to the form field. Runs and checkpoints: ``run_pages``; reward definitions: ``reward_pages``.
"""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from frontend import forms as f
from frontend.access import SESSION_TEAM_KEY, TeamHttpRequest, can_write, get_scoped, team_view
from frontend.presentation import (
    environment_kinds,
    page_of,
    query_without_page,
)
from projects import selectors, services
from projects.errors import DomainError, ValidationFailed
from projects.models import (
    ApiKey,
    BaseModel,
    Environment,
    Invitation,
    Membership,
    Project,
    Role,
    TaskSet,
    TrainableModel,
)

# --- team ------------------------------------------------------------------------------------


@require_POST
@team_view(viewer_may_post=True)
def team_switch(request: TeamHttpRequest) -> HttpResponse:
    wanted = request.POST.get("team")
    for membership in request.memberships:
        if str(membership.team_id) == wanted:
            request.session[SESSION_TEAM_KEY] = membership.team_id
            services.team_choose(user=request.user, team=membership.team)  # type: ignore[arg-type]
            messages.success(request, f"Switched to team {membership.team.name}.")
            break
    else:
        messages.error(request, "You are not a member of that team.")
    return redirect("frontend:projects")


@team_view(owner=True)
def members(request: TeamHttpRequest) -> HttpResponse:
    """The team's members, and the owners' invite form: joining needs the invitee to accept."""
    form = f.InvitationForm(request.POST or None)
    created = None
    if request.method == "POST" and form.is_valid():
        try:
            created = services.invitation_create(
                team=request.team,
                invitee=form.cleaned_data["invitee"],
                role=form.cleaned_data["role"],
                by=request.user,  # type: ignore[arg-type]
            )
            form = f.InvitationForm()
        except ValidationFailed as exc:
            f.attach_errors(form, exc)
    accept_link = None
    if created is not None:
        query = urlencode({"token": created.token})
        accept_link = request.build_absolute_uri(f"{reverse('frontend:invitation-accept')}?{query}")
    return render(
        request,
        "frontend/members.html",
        {
            "members": selectors.team_members(team=request.team),
            "invitations": selectors.pending_invitations(team=request.team),
            "roles": Role.choices,
            "form": form,
            "created": created,
            "accept_link": accept_link,
        },
    )


@require_POST
@team_view(owner=True)
def member_role(request: TeamHttpRequest, membership_id: int) -> HttpResponse:
    membership = get_scoped(Membership, request, membership_id)
    form = f.MemberRoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose one of the roles.")
        return redirect("frontend:members")
    try:
        services.membership_set(
            team=request.team,
            user=membership.user,
            role=form.cleaned_data["role"],
            by=request.user,  # type: ignore[arg-type]
        )
    except DomainError as exc:  # e.g. the last owner demoting themselves
        messages.error(request, exc.message)
        return redirect("frontend:members")
    messages.success(request, f"{membership.user.username} is now {form.cleaned_data['role']}.")
    return redirect("frontend:members")


@require_POST
@team_view(owner=True)
def invitation_revoke(request: TeamHttpRequest, invitation_id: int) -> HttpResponse:
    invitation = get_scoped(Invitation, request, invitation_id)
    try:
        services.invitation_revoke(invitation=invitation, by=request.user)  # type: ignore[arg-type]
    except DomainError as exc:  # already accepted
        messages.error(request, exc.message)
        return redirect("frontend:members")
    messages.success(request, f"The invitation for {invitation.invitee} was revoked.")
    return redirect("frontend:members")


@login_required
def invitation_accept(request: HttpRequest) -> HttpResponse:
    """Where an invitation link leads: sign in, see the team and the role, accept. Not a
    ``team_view``: the person is not a member of the team yet (and may be in no team at all); the
    token decides, through the same checks as ``POST /api/v1/invitations/accept``."""
    token = (request.POST.get("token") if request.method == "POST" else request.GET.get("token")) or ""
    invitation = selectors.invitation_for_token(token=token) if token else None
    error = None
    if request.method == "POST":
        try:
            membership = services.invitation_accept(token=token, user=request.user)  # type: ignore[arg-type]
        except DomainError as exc:
            error = exc
        else:
            request.session[SESSION_TEAM_KEY] = membership.team_id
            messages.success(request, f"You joined {membership.team.name} as {membership.role}.")
            return redirect("frontend:projects")
    else:
        try:
            services.invitation_check(invitation)
        except DomainError as exc:
            error = exc
    status = 200 if error is None else getattr(error, "status_code", 400)
    return render(
        request,
        "frontend/invitation_accept.html",
        {"invitation": invitation if error is None else None, "token": token, "error": error},
        status=status,
    )


@require_POST
@team_view(owner=True)
def member_remove(request: TeamHttpRequest, membership_id: int) -> HttpResponse:
    membership = get_scoped(Membership, request, membership_id)
    try:
        services.membership_remove(team=request.team, user=membership.user, by=request.user)  # type: ignore[attr-defined, arg-type]
    except DomainError as exc:  # the last owner
        messages.error(request, exc.message)
        return redirect("frontend:members")
    if membership.user == request.user:  # left the team: its pages are no longer theirs
        request.session.pop(SESSION_TEAM_KEY, None)
        messages.success(request, f"You left {request.team.name}.")
        return redirect("frontend:projects")
    messages.success(request, f"{membership.user.username} was removed from the team.")
    return redirect("frontend:members")


@team_view(owner=True)
def api_keys(request: TeamHttpRequest) -> HttpResponse:
    form = f.ApiKeyForm(request.POST or None)
    created = None
    if request.method == "POST" and form.is_valid():
        try:
            created = services.api_key_create(
                team=request.team,
                name=form.cleaned_data["name"],
                read_only=form.cleaned_data["read_only"],
                created_by=request.user,  # type: ignore[arg-type]
            )
            form = f.ApiKeyForm()
        except ValidationFailed as exc:
            f.attach_errors(form, exc)
    return render(
        request,
        "frontend/api_keys.html",
        {"keys": selectors.api_keys(team=request.team), "form": form, "created": created},
    )


@require_POST
@team_view(owner=True)
def api_key_revoke(request: TeamHttpRequest, key_id: int) -> HttpResponse:
    api_key = get_scoped(ApiKey, request, key_id)
    services.api_key_revoke(api_key=api_key)
    messages.success(request, f"Key {api_key.name} ({api_key.prefix}) revoked.")
    return redirect("frontend:api-keys")


# --- projects, models ----------------------------------------------------------------------


@team_view()
def projects(request: TeamHttpRequest) -> HttpResponse:
    form = f.ProjectForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            project = services.project_create(team=request.team, **form.cleaned_data)
            return redirect("frontend:project", project_id=project.pk)
        except ValidationFailed as exc:
            f.attach_errors(form, exc)
    items = selectors.scoped(Project, request.team)
    text = request.GET.get("q", "").strip()
    if text:
        items = items.filter(name__icontains=text)
    return render(
        request,
        "frontend/projects.html",
        {
            "page": page_of(request, items.order_by("name")),
            "q": text,
            "form": form,
            "query": query_without_page(request),
        },
    )


@team_view()
def project(request: TeamHttpRequest, project_id: int) -> HttpResponse:
    project = get_scoped(Project, request, project_id)
    model_form = f.TrainableModelForm(request.POST or None, prefix="model")
    f.set_choices(model_form, "base_model", [(b.pk, b.name) for b in BaseModel.objects.order_by("name")])
    environment_form = f.EnvironmentForm(request.POST or None, prefix="environment")
    kinds = environment_kinds()
    if request.method == "POST":
        if "model-name" in request.POST and model_form.is_valid():
            try:
                services.trainable_model_create(
                    project=project,
                    name=model_form.cleaned_data["name"],
                    base_model=BaseModel.objects.get(pk=model_form.cleaned_data["base_model"]),
                )
                return redirect("frontend:project", project_id=project.pk)
            except ValidationFailed as exc:
                f.attach_errors(model_form, exc)
        if "environment-name" in request.POST and environment_form.is_valid():
            data = environment_form.cleaned_data
            if not next(k for k in kinds if k["value"] == data["kind"])["available"]:
                environment_form.add_error(
                    "kind", "this environment kind is not available on this installation"
                )
            else:
                try:
                    services.environment_create(project=project, **environment_form.service_arguments())
                    return redirect("frontend:project", project_id=project.pk)
                except ValidationFailed as exc:
                    f.attach_errors(environment_form, exc)
    team = request.team
    runs = selectors.runs_search(team=team, project_id=project.pk)
    return render(
        request,
        "frontend/project.html",
        {
            "project": project,
            "models": selectors.scoped(TrainableModel, team)
            .filter(project=project)
            .select_related("base_model"),
            "runs": runs[:10],
            "run_count": runs.count(),
            "task_sets": selectors.scoped(TaskSet, team).filter(project=project),
            "environments": selectors.scoped(Environment, team).filter(project=project),
            "rewards": selectors.reward_definitions_latest(team=team, project=project),
            "model_form": model_form,
            "environment_form": environment_form,
            "environment_kinds": kinds,
            "has_endpoints": selectors.judge_endpoints(team=team).exists(),
        },
    )


@team_view()
def model_detail(request: TeamHttpRequest, model_id: int) -> HttpResponse:
    model = get_scoped(TrainableModel, request, model_id)
    team = request.team
    return render(
        request,
        "frontend/model.html",
        {
            "model": model,
            "checkpoints": model.checkpoints.order_by("-step"),
            "page": page_of(request, selectors.runs_search(team=team, model_id=model.pk)),
            "query": query_without_page(request),
            "aliases": [
                (alias, selectors.alias_arms(alias=alias), selectors.alias_events(alias=alias, limit=5))
                for alias in selectors.model_aliases(team=team, model_id=model.pk)
            ],
            "served": selectors.checkpoint_feedback(model=model),
            "can_write": can_write(request),
        },
    )


def root(request: HttpRequest) -> HttpResponse:
    return redirect("frontend:projects")
