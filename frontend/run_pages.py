"""Run pages: the list, a new run, a run's live page (cancel, pause, resume, fork), metrics and
trajectory viewer, and a checkpoint's page with its playground. Reads through projects.selectors,
writes through services.

Why one module of this length: the run page and its live fragments (progress, charts, trajectories,
events) and its forms, which share the run's access checks and context.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.db.models import Max
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from frontend import evaluation_pages
from frontend import forms as f
from frontend.access import TeamHttpRequest, can_write, get_scoped, team_view
from frontend.presentation import (
    KIND_EVALUATES,
    KIND_HAS_REWARDS,
    chart_data,
    chart_series,
    group_summary,
    page_of,
    query_without_page,
    transcript_columns,
)
from projects import selectors, services
from projects.errors import DomainError, ValidationFailed
from projects.formatting import step_label
from projects.models import (
    CLIENT_KINDS,
    Checkpoint,
    Environment,
    Project,
    RewardDefinition,
    Run,
    RunKind,
    RunStatus,
    TaskSet,
    TrainableModel,
)
from projects.selectors.serving import live_servers

# --- runs ------------------------------------------------------------------------------------


@team_view()
def runs(request: TeamHttpRequest) -> HttpResponse:
    team = request.team
    project_id = request.GET.get("project", "")
    status = request.GET.get("status", "")
    text = request.GET.get("q", "").strip()
    items = selectors.runs_search(
        team=team,
        project_id=int(project_id) if project_id.isdecimal() else None,
        status=status if status in RunStatus.values else None,
        text=text,
    )
    return render(
        request,
        "frontend/runs.html",
        {
            "page": page_of(request, items),
            "projects": selectors.scoped(Project, team).order_by("name"),
            "statuses": RunStatus.values,
            "filters": {"project": project_id, "status": status, "q": text},
            "query": query_without_page(request),
        },
    )


def _run_choices(request: TeamHttpRequest, project: Project) -> dict[str, list[tuple[int, str]]]:
    team = request.team
    return {
        "model": [
            (m.pk, f"{m.name} ({m.base_model.name}) — {_starts_from(m.latest_step)}")
            for m in selectors.scoped(TrainableModel, team)
            .filter(project=project)
            .select_related("base_model")
            .annotate(latest_step=Max("checkpoints__step"))
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


def _starts_from(latest_step: int | None) -> str:
    """Where a new run on a model starts: its latest checkpoint, else the base model."""
    return f"continues from checkpoint step {latest_step}" if latest_step else "starts from the base model"


def _run_start(run: Run) -> str:
    """Where ``run`` starts, for its page (fixed when it was created: services.run_create)."""
    if run.forked_from_id is not None:
        return services.run_start_text(run=run).replace("starting", "starts", 1)
    if run.started_at is None:
        if run.status not in services.ACTIVE_STATUSES:
            return ""
        if run.start_step:
            return f"will continue from checkpoint step {run.start_step}"
        return "will start from the base model"
    if run.start_step:
        end = run.start_step + run.total_steps
        return f"continued from checkpoint step {run.start_step} (model steps {run.start_step} to {end})"
    return "started from the base model"


@team_view(write=True)
def run_new(request: TeamHttpRequest, project_id: int) -> HttpResponse:
    project = get_scoped(Project, request, project_id)
    form = f.NewRunForm(
        request.POST or None,
        request.FILES or None,
        choices=_run_choices(request, project),
        last_used=selectors.project_last_run_inputs(project=project),
    )
    if request.method == "POST" and form.is_valid():
        run = _create_run(request, project, form)
        if run is not None:
            messages.success(request, f"Run {run.pk} queued{form.upload_note(run.task_set)}.")
            return redirect("frontend:run", run_id=run.pk)
    if request.method == "POST":
        form.ask_for_the_file_again()
    return render(request, "frontend/run_new.html", {"project": project, "form": form})


def _create_run(request: TeamHttpRequest, project: Project, form: f.NewRunForm) -> Run | None:
    data = form.cleaned_data
    uploaded: TaskSet | None = None
    try:
        if not data["task_file"]:  # a chosen file wins over the (preselected) list: NewRunForm.clean
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
            uploaded = task_set
        return services.run_create(
            model=get_scoped(TrainableModel, request, data["model"], project=project),
            task_set=task_set,
            environment=get_scoped(Environment, request, data["environment"], project=project),
            reward=get_scoped(RewardDefinition, request, data["reward"], project=project),
            config=form.config(),
            created_by=request.user,  # type: ignore[arg-type]
            start_from=form.start(),
            kind=data.get("kind") or "platform",
        )
    except ValidationFailed as exc:
        f.attach_errors(form, exc, rename=f.FIELD_FOR_SERVICE_ERROR)
    except DomainError as exc:  # a 409 naming a field the form has (start_from) is shown at it
        form.add_error(exc.field if exc.field in form.fields else None, exc.message)
    if uploaded is not None:
        form.keep_uploaded(uploaded.pk, f"{uploaded.name} (just uploaded)")
        form.add_error(None, f"The uploaded task set “{uploaded.name}” was saved; it is selected below.")
    return None


def _timing(run: Run) -> dict[str, Any]:
    """Elapsed time and the ETA: the recorded steps' mean duration times the steps left
    (selectors.run_seconds_left; the session opening and step-0 evaluation are no step's time)."""
    if not run.started_at:
        return {"elapsed": None, "eta": None}
    end = run.finished_at or timezone.now()
    # Time spent paused is no time the run ran (a resumed run counted its pause as elapsed).
    elapsed = end - run.started_at - timedelta(seconds=selectors.run_seconds_paused(run=run, until=end))
    left = selectors.run_seconds_left(run=run)
    eta = timedelta(seconds=round(left)) if left is not None else None
    return {"elapsed": timedelta(seconds=round(elapsed.total_seconds())), "eta": eta}


def _step_text(run: Run) -> str:
    """The model's step, as its checkpoints and the events number it. A client run plans no step
    count (its client decides): the steps it made, never "Step 0/0"."""
    if run.kind in CLIENT_KINDS:
        made = f"{run.steps_done} step{'s' if run.steps_done != 1 else ''} made by its client"
        return f"Step {run.current_step} ({made})"
    return step_label(
        run.current_step, start_step=run.start_step, final_step=run.start_step + run.total_steps
    )


def _run_context(request: TeamHttpRequest, run: Run) -> dict[str, Any]:
    client = run.kind in CLIENT_KINDS
    return {
        "run": run,
        "active": run.status in services.ACTIVE_STATUSES,
        "events": selectors.run_recent_events(run=run, limit=50),
        "phase": selectors.run_phase(run=run) if run.status == RunStatus.RUNNING else None,
        "signal_warnings": selectors.run_signal_warnings(run=run),
        "start": _run_start(run),
        "step_text": _step_text(run),
        "client_run": client,
        "checkpoints": selectors.run_checkpoints(run=run),
        "cost": selectors.run_cost(run=run),  # device-hours, tokens and price (projects.selectors.costs)
        # A client run (its steps are its client's training jobs) is stopped at once while running.
        "can_cancel": can_write(request)
        and (run.status == RunStatus.RUNNING if client else run.status in services.ACTIVE_STATUSES)
        and not run.cancel_requested,
        **_run_controls(request, run),
        **_timing(run),
    }


def _run_controls(request: TeamHttpRequest, run: Run) -> dict[str, Any]:
    """Pause, Resume and Fork, for members, on a platform run (a client run's steps are its
    client's training jobs); the fork form offers the model's checkpoints."""
    if not can_write(request) or run.kind in CLIENT_KINDS:
        return {"can_pause": False, "can_resume": False, "fork_form": None}
    steps = list(Checkpoint.objects.filter(model=run.model).order_by("step").values_list("step", flat=True))
    return {
        "can_pause": run.status in (RunStatus.QUEUED, RunStatus.RUNNING)
        and not run.pause_requested
        and not run.cancel_requested,
        "can_resume": run.status == RunStatus.PAUSED,
        "fork_form": f.ForkRunForm(steps=steps, initial={"name": f"{run.model.name}-fork"})
        if steps
        else None,
    }


@team_view()
def run_detail(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    context = _run_context(request, run)
    context["evaluations"] = selectors.run_evaluations(run=run)
    context["config"] = sorted(run.config.items())
    context["chart_series"] = chart_series(run.kind)
    context["has_rewards"] = run.kind in KIND_HAS_REWARDS
    context["evaluates"] = run.kind in KIND_EVALUATES
    return render(request, "frontend/run.html", context)


@require_GET
@team_view()
def run_live(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    """The run page's live part, polled by htmx while the run is active."""
    return render(request, "frontend/_run_live.html", _run_context(request, get_scoped(Run, request, run_id)))


def run_chart_data(run: Run) -> dict[str, Any]:
    """A run's chart series, as the run page draws them (and the compare page overlays them)."""
    return chart_data(
        list(selectors.run_step_metrics(run=run)),
        config=run.config,
        sample_means=selectors.run_step_sample_means(run=run),
        evaluations=list(selectors.run_evaluations(run=run)),
        reward_range=selectors.run_reward_range(run=run),
        kind=run.kind,
        heldout_before=selectors.run_heldout_before(run=run)
        if run.kind in (RunKind.SFT, RunKind.DPO)
        else None,
    )


@require_GET
@team_view()
def run_metrics(request: TeamHttpRequest, run_id: int) -> JsonResponse:
    return JsonResponse(run_chart_data(get_scoped(Run, request, run_id)))


@require_POST
@team_view(write=True)
def run_cancel(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    done = "Run stopped." if run.kind in CLIENT_KINDS else "Cancellation requested."
    f.call_service(request, lambda: services.run_cancel(run=run), success=done)
    return redirect("frontend:run", run_id=run.pk)


@require_POST
@team_view(write=True)
def run_pause(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    f.call_service(
        request,
        lambda: services.run_pause(run=run),
        success="Pause requested: the run pauses after its current step.",
    )
    return redirect("frontend:run", run_id=run.pk)


@require_POST
@team_view(write=True)
def run_resume(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    run = get_scoped(Run, request, run_id)
    f.call_service(request, lambda: services.run_resume(run=run), success="Run resumed: queued again.")
    return redirect("frontend:run", run_id=run.pk)


@require_POST
@team_view(write=True)
def run_fork(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    """Fork from the run page's form; a problem comes back as the run page's message."""
    run = get_scoped(Run, request, run_id)
    steps = list(Checkpoint.objects.filter(model=run.model).order_by("step").values_list("step", flat=True))
    form = f.ForkRunForm(request.POST, steps=steps)
    if not form.is_valid():
        problems = "; ".join(f"{name}: {' '.join(map(str, errors))}" for name, errors in form.errors.items())
        messages.error(request, f"Fork not made: {problems}")
        return redirect("frontend:run", run_id=run.pk)
    try:
        forked = services.run_fork(
            run=run,
            from_step=form.cleaned_data["from_step"],
            name=form.cleaned_data["name"],
            created_by=request.user,  # type: ignore[arg-type]
        )
    except DomainError as exc:
        messages.error(request, f"Fork not made: {exc}")
        return redirect("frontend:run", run_id=run.pk)
    messages.success(request, f"Forked as model {forked.model.name}: run {forked.pk} queued.")
    return redirect("frontend:run", run_id=forked.pk)


@team_view()
def trajectories(request: TeamHttpRequest, run_id: int) -> HttpResponse:
    """One group of one step side by side, with the row's reference ``item``, the group's reward
    mean/std and each sample's advantage as the update used it (selectors.trajectory_update_signals:
    with any length penalty); ``?variance=1`` keeps only groups whose training rewards differ.
    Links to the neighbouring groups and steps carry the keys app.js binds (j/k, [/])."""
    run = get_scoped(Run, request, run_id)
    variance_only = request.GET.get("variance") == "1"
    steps = selectors.trajectory_steps(run=run)
    step = _int(request.GET.get("step"), None)
    if step not in steps:
        step = steps[-1] if steps else None
    groups: list[int] = []
    with_variance: list[int] = []
    if step is not None:
        with_variance = selectors.trajectory_group_indexes_with_variance(run=run, step=step)
        groups = with_variance if variance_only else selectors.trajectory_group_indexes(run=run, step=step)
    group = _int(request.GET.get("group"), None)
    if group not in groups:  # e.g. a group number kept from another step
        group = groups[0] if groups else None
    rows = []
    if step is not None and group is not None:
        rows = selectors.trajectory_group(run=run, step=step, group_index=group)
    signals = selectors.trajectory_update_signals(run=run, trajectories=rows)
    summary = group_summary(rows, signals, scale_rewards=bool(run.config.get("scale_rewards", True)))
    row_indexes = sorted({t.task_row_index for t in rows if t.task_row_index is not None})
    items = selectors.run_task_row_items(run=run, indexes=row_indexes) if row_indexes else {}

    def link(to_step: int | None, to_group: int | None) -> str | None:
        if to_step is None:
            return None
        query = {"step": to_step, **({"group": to_group} if to_group is not None else {})}
        if variance_only:
            query["variance"] = 1
        return "?" + urlencode(query)

    def neighbour(values: list[int], current: int | None, offset: int) -> int | None:
        if current not in values:
            return None
        index = values.index(current) + offset
        return values[index] if 0 <= index < len(values) else None

    previous_group, next_group = neighbour(groups, group, -1), neighbour(groups, group, 1)
    return render(
        request,
        "frontend/trajectories.html",
        {
            "run": run,
            "steps": steps,
            "step": step,
            "groups": [(index, index not in with_variance) for index in groups],
            "group_count": len(groups),
            "group": group,
            "variance_only": variance_only,
            "summary": summary,
            "items": [
                (index, json.dumps(items[index], indent=2, ensure_ascii=False))
                for index in row_indexes
                if index in items
            ],
            "columns": transcript_columns(rows, summary),
            "nav": {
                "previous_group": link(step, previous_group) if previous_group is not None else None,
                "next_group": link(step, next_group) if next_group is not None else None,
                "previous_step": link(neighbour(steps, step, -1), group),
                "next_step": link(neighbour(steps, step, 1), group),
            },
        },
    )


def _int(raw: str | None, default: int | None) -> int | None:
    try:
        return int(raw) if raw not in (None, "") else default  # type: ignore[arg-type]
    except ValueError:
        return default


# --- checkpoints -----------------------------------------------------------------------------


@team_view()
def checkpoint(request: TeamHttpRequest, checkpoint_id: int) -> HttpResponse:
    checkpoint = get_scoped(Checkpoint, request, checkpoint_id)
    model = checkpoint.model
    model_id = f"{model.project.name}/{model.name}:{checkpoint.step}"
    base = model.base_model
    servers = live_servers(base_model=base, affinity=checkpoint.path)
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
            "playground": _playground_defaults(checkpoint),
        },
    )


def _playground_defaults(checkpoint: Checkpoint) -> dict[str, Any]:
    """What the checkpoint was trained and evaluated with: its environment's system prompt and
    its run's evaluation temperature and max new tokens (a prompt it never saw, or a hotter
    temperature, can make a good checkpoint look bad). The model's latest run when the checkpoint
    has none (step 0)."""
    run = checkpoint.run or Run.objects.filter(model=checkpoint.model).select_related("environment").last()
    if run is None:
        return {"system": "", "temperature": 0.7, "max_tokens": 64, "source": None}
    config = run.config or {}
    return {
        "system": run.environment.system_prompt if run.environment else "",
        "temperature": config.get("eval_temperature", 0.0),
        "max_tokens": config.get("max_new_tokens", 64),
        "source": run,
    }


def _checkpoint_evaluation_form(request: TeamHttpRequest, checkpoint: Checkpoint) -> Any:
    """The Evaluate form for members, prefilled with this checkpoint and its run's inputs."""
    if not can_write(request):
        return None
    initial: dict[str, Any] = {"subject": f"checkpoint:{checkpoint.pk}"}
    if checkpoint.run is not None:
        run = checkpoint.run
        initial.update(task_set=run.task_set_id, environment=run.environment_id, reward=run.reward_id)
    initial["pass_threshold"] = services.run_pass_threshold(checkpoint)  # the run's, as the API's default
    return evaluation_pages.evaluation_form(request, initial=initial)
