"""Models a client trains (``/v1/preview/models``): registered under any name ART accepts, each
with its client run and a step 0 that answers at once; deleted with its runs and files unless
something trains it."""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from projects.client_names import check_client_name, client_slug
from projects.errors import Conflict, NotFound, ValidationFailed
from projects.models import (
    CLIENT_KINDS,
    BaseModel,
    Checkpoint,
    Project,
    Run,
    RunKind,
    RunStatus,
    Team,
    TrainableModel,
    TrainingJob,
    TrainingJobStatus,
)
from projects.services.checkpoints import model_files_remove_on_commit
from projects.services.projects import trainable_model_create
from projects.services.runs import ACTIVE_STATUSES, run_event_add
from projects.services.steps import checkpoint_record
from training.recipes.art_config import art_job_config

UNFINISHED = (TrainingJobStatus.QUEUED, TrainingJobStatus.RUNNING)


def client_model_register(
    *,
    team: Team,
    entity: str | None,
    project: str,
    name: str,
    base_model: str,
    return_existing: bool = True,
) -> tuple[TrainableModel, Run]:
    """The model ``project/name`` of ``team`` on ``base_model`` and its client run, created if
    missing (its project too), with checkpoint 0 answering at once (see Checkpoint).

    ``entity`` is the team's name or None (the caller's team); another name is a 404, whether or
    not such a team exists. An existing model is returned when ``return_existing``, a 409 when it
    is on another base model.
    """
    if entity is not None and entity != team.name:
        raise NotFound(
            f"no team named {entity!r} is yours: entity is your team's name ({team.name!r}) or null",
            field="entity",
        )
    if not isinstance(base_model, str) or not base_model:
        raise ValidationFailed("must be a non-empty string", field="base_model")
    # Any name ART accepts; stored as its slug (projects.client_names), replies name it as sent.
    project = client_slug(check_client_name(project, "project"))
    name = client_slug(check_client_name(name, "name"))
    base = BaseModel.objects.filter(name=base_model).first()
    if base is None:
        registered = ", ".join(BaseModel.objects.order_by("name").values_list("name", flat=True)) or "none"
        raise ValidationFailed(
            f"no base model named {base_model!r} is registered; registered base models: {registered}",
            field="base_model",
        )
    with transaction.atomic():
        owner, _ = Project.objects.get_or_create(team=team, name=project)
        model = TrainableModel.objects.select_for_update().filter(project=owner, name=name).first()
        if model is not None:
            if not return_existing:
                raise Conflict(f"a model named {project}/{name} already exists", code="model_exists")
            if model.base_model_id != base.pk:
                raise Conflict(
                    f"the model {project}/{name} exists on base model {model.base_model.name!r}, "
                    f"not {base.name!r}",
                    field="base_model",
                    code="base_model_mismatch",
                )
        else:
            model = trainable_model_create(project=owner, name=name, base_model=base)
            TrainableModel.objects.select_for_update().get(pk=model.pk)
        return model, client_run_of(model)


def client_run_of(model: TrainableModel) -> Run:
    """The model's running client run (the caller holds the model row's lock); a new one, from the
    model's latest checkpoint, when the last one ended (stopped, or idle: run_control), created
    with the model's step 0 if it has no checkpoint yet."""
    run = Run.objects.filter(model=model, kind=RunKind.CLIENT).order_by("-id").first()
    if run is not None and run.status == RunStatus.RUNNING:
        return run
    latest = Checkpoint.objects.filter(model=model).order_by("-step").first()
    step = latest.step if latest else 0
    now = timezone.now()
    run = Run.objects.create(
        kind=RunKind.CLIENT,
        project=model.project,
        model=model,
        config=art_job_config(None)[0].to_dict(),
        status=RunStatus.RUNNING,
        start_step=step,
        current_step=step,
        total_steps=0,
        started_at=now,
        heartbeat_at=now,
    )
    run_event_add(
        run=run,
        message=f"Client run started at step {step}: each step is a training job a client submits "
        "(POST /v1/preview/training-jobs, e.g. OpenPipe ART's ServerlessBackend)",
    )
    if latest is None:
        checkpoint_record(model=model, run=run, step=0, path="", metrics={})
    return run


def client_model_delete(*, model: TrainableModel) -> None:
    """Delete a model, its runs and checkpoints (rows, then files); 409 while it is training."""
    with transaction.atomic():
        TrainableModel.objects.select_for_update().get(pk=model.pk)
        _refuse_while_training(model, what="delete the model")
        Run.objects.filter(model=model).delete()
        model_files_remove_on_commit(model_ids=[model.pk])
        model.delete()


def _refuse_while_training(model: TrainableModel, *, what: str) -> None:
    job = TrainingJob.objects.filter(model=model, status__in=UNFINISHED).order_by("id").first()
    if job is not None:
        raise Conflict(
            f"cannot {what}: training job {job.pk} is {job.status} on this model", code="model_busy"
        )
    run = platform_run_active(model=model)
    if run is not None:
        raise Conflict(f"cannot {what}: run #{run.pk} is {run.status} on this model", code="model_busy")


def platform_run_active(*, model: TrainableModel) -> Run | None:
    return (
        Run.objects.filter(model=model, status__in=ACTIVE_STATUSES)
        .exclude(kind__in=CLIENT_KINDS)
        .order_by("id")
        .first()
    )


def training_job_active(*, model: TrainableModel) -> TrainingJob | None:
    """The model's first unfinished training job (services.runs refuses a run while there is one)."""
    return TrainingJob.objects.filter(model=model, status__in=UNFINISHED).order_by("id").first()
