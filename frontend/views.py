"""Dashboard pages. Each view: resolve the team (``team_view``), read through projects.selectors,
write through projects.services, render a template. Domain errors go back to the form field.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from frontend import evaluation_pages
from frontend import forms as f
from frontend.access import SESSION_TEAM_KEY, TeamHttpRequest, can_write, get_scoped, team_view
from frontend.presentation import chart_data, environment_kinds, transcript_columns
from projects import selectors, services
from projects.errors import DomainError, ValidationFailed
from projects.gateway import routing
from projects.models import (
    ApiKey,
    BaseModel,
    Checkpoint,
    Environment,
    Membership,
    Project,
    RewardDefinition,
    Run,
    RunStatus,
    TaskSet,
    TrainableModel,
)

PAGE_SIZE = 20


def _page(request: HttpRequest, items: Any) -> Any:
    return Paginator(items, PAGE_SIZE).get_page(request.GET.get("page"))


def _query_without_page(request: HttpRequest) -> str:
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()


# --- team ------------------------------------------------------------------------------------


@require_POST
@team_view(viewer_may_post=True)
def team_switch(request: TeamHttpRequest) -> HttpResponse:
    wanted = request.POST.get("team")
    for membership in request.memberships:
        if str(membership.team_id) == wanted:
            request.session[SESSION_TEAM_KEY] = membership.team_id
            messages.success(request, f"Switched to team {membership.team.name}.")
            break
    else:
        messages.error(request, "You are not a member of that team.")
    return redirect("frontend:projects")


@team_view(owner=True)
def members(request: TeamHttpRequest) -> HttpResponse:
    form = f.MemberForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = get_user_model().objects.filter(username=form.cleaned_data["username"]).first()
        if user is None:
            form.add_error("username", "no user with this name")
        else:
            try:
                services.membership_set(
                    team=request.team,
                    user=user,
                    role=form.cleaned_data["role"],
                    by=request.user,  # type: ignore[arg-type]
                )
                messages.success(request, f"{user.username} is now {form.cleaned_data['role']}.")
                return redirect("frontend:members")
            except DomainError as exc:  # e.g. the last owner demoting themselves
                form.add_error("role", exc.message)
    return render(
        request,
        "frontend/members.html",
        {"members": selectors.team_members(team=request.team), "form": form},
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
            "page": _page(request, items.order_by("name")),
            "q": text,
            "form": form,
            "query": _query_without_page(request),
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
            "page": _page(request, selectors.runs_search(team=team, model_id=model.pk)),
            "query": _query_without_page(request),
        },
    )


# --- runs ------------------------------------------------------------------------------------


@team_view()
def runs(request: TeamHttpRequest) -> HttpResponse:
    team = request.team
    project_id = request.GET.get("project", "")
    status = request.GET.get("status", "")
    text = request.GET.get("q", "").strip()
    items = selectors.runs_search(
        team=team,
        project_id=int(project_id) if project_id.isdigit() else None,
        status=status if status in RunStatus.values else None,
        text=text,
    )
    return render(
        request,
        "frontend/runs.html",
        {
            "page": _page(request, items),
            "projects": selectors.scoped(Project, team).order_by("name"),
            "statuses": RunStatus.values,
            "filters": {"project": project_id, "status": status, "q": text},
            "query": _query_without_page(request),
        },
    )


def _run_choices(request: TeamHttpRequest, project: Project) -> dict[str, list[tuple[int, str]]]:
    team = request.team
    return {
        "model": [
            (m.pk, f"{m.name} ({m.base_model.name})")
            for m in selectors.scoped(TrainableModel, team)
            .filter(project=project)
            .select_related("base_model")
        ],
        "task_set": [
            (t.pk, f"{t.name} ({t.train_count} train / {t.validation_count} validation rows)")
            for t in selectors.scoped(TaskSet, team).filter(project=project)
        ],
        "environment": [
            (e.pk, f"{e.name} ({e.kind}, {e.max_turns} turn{'s' if e.max_turns != 1 else ''})")
            for e in selectors.scoped(Environment, team).filter(project=project)
        ],
        "reward": [
            (r.pk, f"{r.name} v{r.version}")
            for r in selectors.reward_definitions_latest(team=team, project=project)
        ],
    }


@team_view(write=True)
def run_new(request: TeamHttpRequest, project_id: int) -> HttpResponse:
    project = get_scoped(Project, request, project_id)
    form = f.NewRunForm(request.POST or None, request.FILES or None, choices=_run_choices(request, project))
    if request.method == "POST" and form.is_valid():
        run = _create_run(request, project, form)
        if run is not None:
            messages.success(request, f"Run {run.pk} queued.")
            return redirect("frontend:run", run_id=run.pk)
    return render(request, "frontend/run_new.html", {"project": project, "form": form})


def _create_run(request: TeamHttpRequest, project: Project, form: f.NewRunForm) -> Run | None:
    data = form.cleaned_data
    try:
        if data["task_set"]:
            task_set = get_scoped(TaskSet, request, data["task_set"], project=project)
        else:
            upload = data["task_file"]
            try:
                text = upload.read().decode("utf-8")
            except UnicodeDecodeError as exc:
                form.add_error("task_file", f"not UTF-8 text (byte {exc.start})")
                return None
            task_set = services.task_set_create(
                project=project,
                name=data["task_set_name"],
                jsonl=text,
                validation_fraction=data["validation_fraction"],
            )
        return services.run_create(
            model=get_scoped(TrainableModel, request, data["model"], project=project),
            task_set=task_set,
            environment=get_scoped(Environment, request, data["environment"], project=project),
            reward=get_scoped(RewardDefinition, request, data["reward"], project=project),
            config=form.config(),
            created_by=request.user,  # type: ignore[arg-type]
        )
    except ValidationFailed as exc:
        f.attach_errors(form, exc, rename=f.FIELD_FOR_SERVICE_ERROR)
    except DomainError as exc:
        form.add_error(None, exc.message)
    return None


def _timing(run: Run) -> dict[str, Any]:
    """Elapsed time and a simple ETA: the mean time per finished step times the steps left."""
    if not run.started_at:
        return {"elapsed": None, "eta": None}
    end = run.finished_at or timezone.now()
    elapsed = end - run.started_at
    done, total = run.steps_done, run.total_steps
    eta = None
    if run.status == RunStatus.RUNNING and 0 < done < total:
        eta = timedelta(seconds=round(elapsed.total_seconds() / done * (total - done)))
    return {"elapsed": timedelta(seconds=round(elapsed.total_seconds())), "eta": eta}


def _run_context(request: TeamHttpRequest, run: Run) -> dict[str, Any]:
    done = run.steps_done
    return {
        "run": run,
        "active": run.status in services.ACTIVE_STATUSES,
        "percent": round(100 * done / run.total_steps) if run.total_steps else 0,
        "events": selectors.run_recent_events(run=run, limit=50),
        "checkpoints": selectors.run_checkpoints(run=run),
        "can_cancel": can_write(request)
        and run.status in services.ACTIVE_STATUSES
        and not run.cancel_requested,
        **_timing(run),
    }


@team_view()
def run_detail(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    context = _run_context(request, run)
    context["evaluations"] = selectors.run_evaluations(run=run)
    context["config"] = sorted(run.config.items())
    return render(request, "frontend/run.html", context)


@require_GET
@team_view()
def run_live(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    """The run page's live part, polled by htmx while the run is active."""
    return render(request, "frontend/_run_live.html", _run_context(request, get_scoped(Run, request, run_id)))


@require_GET
@team_view()
def run_metrics(request: TeamHttpRequest, run_id: int) -> JsonResponse:
    run = get_scoped(Run, request, run_id)
    return JsonResponse(chart_data(list(selectors.run_step_metrics(run=run))))


@require_POST
@team_view(write=True)
def run_cancel(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    try:
        services.run_cancel(run=run)
        messages.success(request, "Cancellation requested.")
    except DomainError as exc:
        messages.error(request, exc.message)
    return redirect("frontend:run", run_id=run.pk)


@team_view()
def trajectories(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    steps = selectors.trajectory_steps(run=run)
    step = _int(request.GET.get("step"), None)
    if step not in steps:
        step = steps[-1] if steps else None
    groups = selectors.trajectory_group_indexes(run=run, step=step) if step is not None else []
    group = _int(request.GET.get("group"), None)
    if group not in groups:  # e.g. a group number kept from another step
        group = groups[0] if groups else None
    rows = []
    if step is not None and group is not None:
        rows = selectors.trajectory_group(run=run, step=step, group_index=group)
    return render(
        request,
        "frontend/trajectories.html",
        {
            "run": run,
            "steps": steps,
            "step": step,
            "groups": groups,
            "group": group,
            "columns": transcript_columns(rows),
        },
    )


def _int(raw: str | None, default: int | None) -> int | None:
    try:
        return int(raw) if raw not in (None, "") else default  # type: ignore[arg-type]
    except ValueError:
        return default


# --- reward definitions ----------------------------------------------------------------------

EXAMPLE_SPEC = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "ilike",
}


@team_view()
def rewards(request: TeamHttpRequest, project_id: int) -> HttpResponse:
    project = get_scoped(Project, request, project_id)
    form = f.RewardDefinitionForm(request.POST or None, initial={"spec": json.dumps(EXAMPLE_SPEC, indent=2)})
    if request.method == "POST" and form.is_valid():
        spec = _json_field(form, "spec")
        if spec is not None:
            try:
                definition = services.reward_definition_create(
                    project=project, name=form.cleaned_data["name"], spec=spec
                )
                return redirect("frontend:reward", reward_id=definition.pk)
            except ValidationFailed as exc:
                f.attach_errors(form, exc)
    return render(
        request,
        "frontend/rewards.html",
        {
            "project": project,
            "definitions": selectors.reward_definitions_latest(team=request.team, project=project),
            "form": form,
        },
    )


def _json_field(form: Any, name: str) -> Any:
    try:
        return json.loads(form.cleaned_data[name])
    except json.JSONDecodeError as exc:
        form.add_error(name, f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})")
        return None


@team_view()
def reward(request: TeamHttpRequest, reward_id: int) -> HttpResponse:
    definition = get_scoped(RewardDefinition, request, reward_id)
    form = f.RewardDefinitionForm(
        request.POST or None, initial={"name": definition.name, "spec": json.dumps(definition.spec, indent=2)}
    )
    form.fields["name"].disabled = True
    if request.method == "POST" and form.is_valid():
        spec = _json_field(form, "spec")
        if spec is not None:
            try:
                created = services.reward_definition_update(definition=definition, spec=spec)
                messages.success(request, f"Saved as version {created.version}.")
                return redirect("frontend:reward", reward_id=created.pk)
            except ValidationFailed as exc:
                f.attach_errors(form, exc)
    return render(
        request,
        "frontend/reward.html",
        {
            "definition": definition,
            "versions": selectors.reward_definition_versions(definition=definition),
            "form": form,
            "example_item": json.dumps({"answer": "42"}),
        },
    )


@require_POST
@team_view()
def grader_validate(request: TeamHttpRequest) -> JsonResponse:
    """Validation as you type in the reward editor: the same check as ``POST
    /api/v1/graders/validate`` (``services.grader_problems``), but a spec with problems is an
    answer (200), not a failed request, so typing does not fill the browser console with 400s."""
    try:
        spec = json.loads(request.body).get("grader")
    except (ValueError, AttributeError):
        return JsonResponse({"valid": False, "problems": ["the body must be a JSON object with a grader"]})
    try:
        normalised = services.grader_problems(spec, field="grader")
    except ValidationFailed as exc:
        return JsonResponse(
            {"valid": False, "problems": [f"{field}: {message}" for field, message in exc.problems]}
        )
    return JsonResponse({"valid": True, "grader": normalised})


# --- checkpoints -----------------------------------------------------------------------------


@team_view()
def checkpoint(request: TeamHttpRequest, checkpoint_id: int) -> HttpResponse:
    checkpoint = get_scoped(Checkpoint, request, checkpoint_id)
    model = checkpoint.model
    model_id = f"{model.project.name}/{model.name}:{checkpoint.step}"
    base = model.base_model
    servers = routing.live_servers(base_model=base, affinity=checkpoint.path)
    gateway_url = request.build_absolute_uri("/v1")
    return render(
        request,
        "frontend/checkpoint.html",
        {
            "checkpoint": checkpoint,
            "model": model,
            "model_id": model_id,
            "base_model": base,
            "server_count": len(servers),
            "metrics": sorted((k, v) for k, v in checkpoint.metrics.items() if isinstance(v, int | float)),
            "evaluations": selectors.checkpoint_evaluations(checkpoint=checkpoint),
            "evaluation_form": _checkpoint_evaluation_form(request, checkpoint),
            "gateway_url": gateway_url,
            "playground_url": reverse("frontend:playground-chat"),
        },
    )


def _checkpoint_evaluation_form(request: TeamHttpRequest, checkpoint: Checkpoint) -> Any:
    """The Evaluate form for members, prefilled with this checkpoint and its run's inputs."""
    if not can_write(request):
        return None
    initial: dict[str, Any] = {"subject": f"checkpoint:{checkpoint.pk}"}
    if checkpoint.run is not None:
        run = checkpoint.run
        initial.update(task_set=run.task_set_id, environment=run.environment_id, reward=run.reward_id)
    return evaluation_pages.evaluation_form(request, initial=initial)


def root(request: HttpRequest) -> HttpResponse:
    return redirect("frontend:projects")
