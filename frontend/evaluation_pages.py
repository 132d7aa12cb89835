"""Evaluation pages: the team's evaluations, the form that queues one (resolved and created by the
same selector and service as ``POST /api/v1/evaluations``), and an evaluation's page:
status and events (live while it is queued or running), results, and its samples per task row,
the subject beside the reference."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST

from frontend import forms as f
from frontend.access import TeamHttpRequest, can_write, get_scoped, team_view
from frontend.presentation import evaluation_results, evaluation_sample_rows
from projects import selectors, services
from projects.errors import ValidationFailed
from projects.models import (
    BaseModel,
    Checkpoint,
    Environment,
    Evaluation,
    EvaluationStatus,
    Project,
    Run,
    TaskSet,
    TrainableModel,
)
from projects.secrets import url_public

ROWS_PER_PAGE = 10
ACTIVE = (EvaluationStatus.QUEUED, EvaluationStatus.RUNNING)


@team_view()
def evaluation_list(request: TeamHttpRequest) -> HttpResponse:
    team = request.team
    project_id = request.GET.get("project", "")
    status = request.GET.get("status", "")
    items = selectors.evaluations_list(
        team=team,
        project_id=int(project_id) if project_id.isdecimal() else None,
        status=status if status in EvaluationStatus.values else None,
    ).select_related(
        "task_set", "reference_checkpoint__model__project", "reference_base_model", "reference_endpoint"
    )
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "frontend/evaluations.html",
        {
            "page": Paginator(items, 20).get_page(request.GET.get("page")),
            "projects": selectors.scoped(Project, team).order_by("name"),
            "statuses": EvaluationStatus.values,
            "filters": {"project": project_id, "status": status},
            "query": query.urlencode(),
        },
    )


def _model_choices(team: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    checkpoints = [
        (f"checkpoint:{c.pk}", selectors.model_label(c, None))
        for c in selectors.scoped(Checkpoint, team)
        .select_related("model__project")
        .order_by("model__project__name", "model__name", "-step")
    ]
    base_models = [
        (f"base:{b.pk}", f"{b.name} (base model, no adapter)") for b in BaseModel.objects.order_by("name")
    ]
    return checkpoints, base_models


def _choices(team: Any, subject_model: TrainableModel | None = None) -> dict[str, list[Any]]:
    """Every choice across the team's projects, labelled with the project (the service checks that
    the task set, environment and reward definition share one). With ``subject_model`` the model
    to evaluate is one of its checkpoints or its base model (the reference stays any)."""
    checkpoints, base_models = _model_choices(team)
    subject = [("Checkpoints", checkpoints), ("Base models", base_models)]
    if subject_model is not None:
        own = {
            f"checkpoint:{pk}"
            for pk in Checkpoint.objects.filter(model=subject_model).values_list("pk", flat=True)
        }
        subject = [
            (f"Checkpoints of {subject_model.name}", [c for c in checkpoints if c[0] in own]),
            ("Its base model", [b for b in base_models if b[0] == f"base:{subject_model.base_model_id}"]),
        ]
    endpoints = [
        (f"endpoint:{e.pk}", f"{e.name} ({url_public(e.base_url)})")
        for e in selectors.judge_endpoints(team=team)
    ]
    projects = list(selectors.scoped(Project, team).order_by("name"))
    return {
        "subject": subject,
        "task_set": [
            (t.pk, f"{t.project.name} / {t.name} ({t.train_count} train / {t.validation_count} validation)")
            for t in selectors.scoped(TaskSet, team)
            .select_related("project")
            .order_by("project__name", "name")
        ],
        "split": [(split, split) for split in services.EVALUATION_SPLITS],
        "environment": [
            (e.pk, f"{e.project.name} / {e.name} ({e.kind})")
            for e in selectors.scoped(Environment, team)
            .select_related("project")
            .order_by("project__name", "name")
        ],
        "reward": [
            (r.pk, f"{project.name} / {r.name} v{r.version}")
            for project in projects
            for r in selectors.reward_definitions_latest(team=team, project=project)
        ],
        "reference": [
            (f.REFERENCE_NONE, "— none —"),
            ("Checkpoints", checkpoints),
            ("Base models", base_models),
            ("Team endpoints", endpoints),
        ],
    }


def _choice_of(checkpoint_id: int | None, base_model_id: int | None, endpoint_id: int | None = None) -> str:
    """The form's choice for an evaluation's subject or reference (empty: none)."""
    for kind, pk in (("checkpoint", checkpoint_id), ("base", base_model_id), ("endpoint", endpoint_id)):
        if pk:
            return f"{kind}:{pk}"
    return ""


def _initial(request: TeamHttpRequest) -> dict[str, Any]:
    """``?checkpoint=<id>`` evaluates that checkpoint; ``?run=<id>`` a run's (a fine-tuning job's)
    newest checkpoint on its rows with its environment and reward, to compare against a reference (a
    golden comparison: the model it replaces, same rows, same grader); ``?from=<evaluation id>``
    repeats an evaluation's settings (the team's own rows only: anything else is ignored)."""
    initial: dict[str, Any] = {}
    run_id = request.GET.get("run", "")
    if run_id.isdecimal():
        run = get_scoped(Run, request, int(run_id))
        inputs = selectors.run_evaluation_inputs(run=run)
        initial.update({name: inputs[name] for name in ("task_set", "environment", "reward", "split")})
        if inputs["checkpoint"] is not None:
            initial["subject"] = f"checkpoint:{inputs['checkpoint']}"
    checkpoint_id = request.GET.get("checkpoint", "")
    if checkpoint_id.isdecimal():
        checkpoint = get_scoped(Checkpoint, request, int(checkpoint_id))
        initial["subject"] = f"checkpoint:{checkpoint.pk}"
        initial["pass_threshold"] = services.run_pass_threshold(checkpoint)  # the run's, as the API's default
    source_id = request.GET.get("from", "")
    if source_id.isdecimal():
        source = get_scoped(Evaluation, request, int(source_id))
        initial.update(
            {
                name: getattr(source, name)
                for name in ("split", "pass_threshold", "samples_per_row", "max_rows")
            },
            task_set=source.task_set_id,
            environment=source.environment_id,
            reward=source.reward_id,
            temperature=source.config.get("temperature", 0.0),
            reference_model=source.reference_model,
        )
        subject = _choice_of(source.checkpoint_id, source.base_model_id)
        if subject:
            initial.setdefault("subject", subject)
        reference = _choice_of(
            source.reference_checkpoint_id, source.reference_base_model_id, source.reference_endpoint_id
        )
        if reference:
            initial["reference"] = reference
    return initial


def evaluation_form(
    request: TeamHttpRequest,
    data: Any = None,
    initial: dict[str, Any] | None = None,
    subject_model: TrainableModel | None = None,
) -> f.EvaluationForm:
    return f.EvaluationForm(data, initial=initial or {}, choices=_choices(request.team, subject_model))


@team_view(write=True)
def evaluation_new(request: TeamHttpRequest) -> HttpResponse:
    """``?model=<id>`` narrows the model to evaluate to that model's checkpoints (the filter form
    above the form; htmx swaps only the field when the select changes)."""
    model_id = request.GET.get("model", "")
    subject_model = (
        get_scoped(TrainableModel, request, int(model_id))
        if model_id.isdecimal() and not request.POST
        else None
    )
    form = evaluation_form(request, request.POST or None, _initial(request), subject_model)
    if request.method == "POST" and form.is_valid():
        evaluation = _create(request, form)
        if evaluation is not None:
            messages.success(request, f"Evaluation {evaluation.pk} queued.")
            return redirect("frontend:evaluation", evaluation_id=evaluation.pk)
    models = (
        selectors.scoped(TrainableModel, request.team)
        .select_related("project")
        .order_by("project__name", "name")
    )
    return render(
        request,
        "frontend/evaluation_new.html",
        {"form": form, "models": models, "subject_model": subject_model},
    )


def _model_choice(value: str, endpoint_model: str = "") -> selectors.ModelChoice:
    """A subject or reference choice (``checkpoint:<id>``, ``base:<id>``, ``endpoint:<id>``) as the
    selector that resolves the API's requests takes it."""
    kind, pk = f.split_choice(value)
    if kind == "checkpoint":
        return selectors.ModelChoice(checkpoint=pk)
    if kind == "base":
        return selectors.ModelChoice(base_model=pk)
    return selectors.ModelChoice(endpoint=pk, endpoint_model=endpoint_model)


def _create(request: TeamHttpRequest, form: f.EvaluationForm) -> Evaluation | None:
    data = form.cleaned_data
    try:
        inputs = selectors.evaluation_inputs_resolve(
            team=request.team,
            subject=_model_choice(data["subject"]),
            task_set=data["task_set"],
            environment=data["environment"],
            reward=data["reward"],
            reference=_model_choice(data["reference"], data["reference_model"])
            if data["reference"]
            else None,
        )
        return services.evaluation_create(
            **inputs,
            **{name: data[name] for name in services.EVALUATION_SETTINGS if name in data},
            created_by=request.user,  # type: ignore[arg-type]
        )
    except ValidationFailed as exc:
        f.attach_errors(form, exc, rename=f.EVALUATION_FIELD_FOR_SERVICE_ERROR)
    return None


def _context(request: TeamHttpRequest, evaluation: Evaluation) -> dict[str, Any]:
    row_indexes = selectors.evaluation_sample_row_indexes(evaluation=evaluation)
    page = Paginator(row_indexes, ROWS_PER_PAGE).get_page(request.GET.get("page"))
    samples = selectors.evaluation_samples_of_rows(evaluation=evaluation, row_indexes=list(page.object_list))
    return {
        "evaluation": evaluation,
        "active": evaluation.status in ACTIVE,
        "subject_label": selectors.model_label(evaluation.checkpoint, evaluation.base_model)
        or "deleted checkpoint",
        "reference_label": selectors.evaluation_reference_label(evaluation),
        "results": evaluation_results(
            evaluation.results, has_reference=selectors.evaluation_reference(evaluation) is not None
        ),
        "passes": selectors.evaluation_passes(evaluation=evaluation),
        "events": selectors.evaluation_recent_events(evaluation=evaluation),
        "page": page,
        "sample_rows": evaluation_sample_rows(list(samples)),
        "can_cancel": can_write(request) and evaluation.status in ACTIVE,
        "can_write": can_write(request),
    }


def _get(request: TeamHttpRequest, evaluation_id: int) -> Evaluation:
    """The team's evaluation with the relations its page labels read (one query), else 404."""
    evaluation = (
        selectors.scoped(Evaluation, request.team)
        .select_related(
            "project",
            "task_set",
            "environment",
            "reward",
            "checkpoint__model__project",
            "base_model",
            "reference_checkpoint__model__project",
            "reference_base_model",
            "reference_endpoint",
        )  # fmt: skip
        .filter(pk=evaluation_id)
        .first()
    )
    if evaluation is None:
        raise Http404("no such evaluation")
    return evaluation


@team_view()
def evaluation_detail(request: TeamHttpRequest, evaluation_id: int) -> HttpResponse:
    return render(request, "frontend/evaluation.html", _context(request, _get(request, evaluation_id)))


@require_GET
@team_view()
def evaluation_live(request: TeamHttpRequest, evaluation_id: int) -> HttpResponse:
    """The evaluation page's live part, polled by htmx while the evaluation is queued or running."""
    return render(request, "frontend/_evaluation_live.html", _context(request, _get(request, evaluation_id)))


@require_POST
@team_view(write=True)
def evaluation_cancel(request: TeamHttpRequest, evaluation_id: int) -> HttpResponse:
    evaluation = get_scoped(Evaluation, request, evaluation_id)
    f.call_service(
        request, lambda: services.evaluation_cancel(evaluation=evaluation), success="Evaluation cancelled."
    )
    return redirect("frontend:evaluation", evaluation_id=evaluation.pk)
