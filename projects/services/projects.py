"""Projects, the base model catalogue and the trainable models (LoRA adapters) in a project."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from projects.errors import Conflict, ValidationFailed
from projects.models import CLIENT_KINDS, BaseModel, Project, Run, Team, TrainableModel, TrainingJob
from projects.queues import queue_name_problem
from projects.services._common import (
    check_devices,
    check_fsdp,
    check_slug,
    check_storable,
    check_text_length,
    config_invalid,
    create_unique,
    delete_unless_used,
)
from projects.services.checkpoints import model_files_remove_on_commit, retention_check
from projects.services.runs import ACTIVE_STATUSES
from training.config import ConfigError, LoraSpec

DESCRIPTION_MAX_CHARS = 10_000  # a project's description: a paragraph or a few, not a document


def project_create(*, team: Team, name: str, description: str = "") -> Project:
    check_slug(name, "name")
    check_text_length(description, field="description", max_chars=DESCRIPTION_MAX_CHARS)
    return create_unique(
        lambda: Project.objects.create(team=team, name=name, description=description),
        field="name",
        message=f"a project named {name!r} already exists in this team",
    )


def project_update(*, project: Project, name: str | None = None, description: str | None = None) -> Project:
    if name is not None:
        check_slug(name, "name")
        project.name = name
    if description is not None:
        check_text_length(description, field="description", max_chars=DESCRIPTION_MAX_CHARS)
        project.description = description
    create_unique(project.save, field="name", message=f"a project named {name!r} already exists in this team")
    return project


def project_delete(*, project: Project) -> None:
    if project.runs.filter(status__in=ACTIVE_STATUSES).exclude(kind__in=CLIENT_KINDS).exists():
        raise Conflict("the project has active runs; cancel them first", code="in_use")
    if TrainingJob.objects.filter(model__project=project, status__in=("queued", "running")).exists():
        raise Conflict(
            "a client is training a model of this project; wait for its training job", code="in_use"
        )
    with transaction.atomic():
        # Runs protect their inputs; deleting a project deletes its runs first, then the rest.
        Run.objects.filter(project=project).delete()
        model_files_remove_on_commit(model_ids=list(project.models.values_list("pk", flat=True)))
        delete_unless_used(project, "project")


def base_model_register(
    *, name: str, source: str, description: str = "", queue: str | None = None
) -> BaseModel:
    """Add or update a catalogue entry. ``queue``: the work queue of its runs, evaluations and
    training jobs (projects.queues); ``""`` is the settings' default, None keeps what it was."""
    if not name.strip():
        raise ValidationFailed("must not be empty", field="name")
    if not source.strip():
        raise ValidationFailed("must not be empty", field="source")
    defaults = {"source": source, "description": description}
    if queue is not None:
        if queue and (problem := queue_name_problem(queue)):
            raise ValidationFailed(problem, field="queue")
        defaults["queue"] = queue
    model, _ = BaseModel.objects.update_or_create(name=name, defaults=defaults)
    return model


def _lora(lora: dict[str, Any] | None) -> dict[str, Any]:
    check_storable(lora, field="lora")
    try:
        return LoraSpec.from_dict(lora or {}).to_dict()
    except ConfigError as exc:
        raise config_invalid(exc, "lora.") from exc


def trainable_model_create(
    *,
    project: Project,
    name: str,
    base_model: BaseModel,
    lora: dict[str, Any] | None = None,
    devices: int = 1,
    fsdp: bool = False,
) -> TrainableModel:
    check_slug(name, "name")
    spec = _lora(lora)
    devices = check_devices(devices, field="devices")
    check_fsdp(fsdp, devices, field="fsdp")
    return create_unique(
        lambda: TrainableModel.objects.create(
            project=project, name=name, base_model=base_model, lora=spec, devices=devices, fsdp=fsdp
        ),
        field="name",
        message=f"a model named {name!r} already exists in this project",
    )


def trainable_model_update(
    *,
    model: TrainableModel,
    lora: dict[str, Any] | None = None,
    retention: dict[str, Any] | None = None,
    devices: int | None = None,
    fsdp: bool | None = None,
) -> TrainableModel:
    """``retention`` (services.checkpoints.retention_check; ``{}`` keeps everything) applies from
    the next step on; ``POST /models/{id}/checkpoints/prune`` applies one now. ``devices``: from
    the model's next client training job on, and ``fsdp`` (its base sharded across them)."""
    if lora is not None:
        if model.checkpoints.exists():
            raise Conflict("the LoRA shape cannot change once the model has checkpoints", code="in_use")
        model.lora = _lora(lora)
        model.save(update_fields=["lora"])
    if retention is not None:
        model.retention = retention_check(retention, field="retention")
        model.save(update_fields=["retention"])
    if devices is not None or fsdp is not None:
        devices = model.devices if devices is None else check_devices(devices, field="devices")
        fsdp = model.fsdp if fsdp is None else fsdp
        check_fsdp(fsdp, devices, field="fsdp")
        model.devices, model.fsdp = devices, fsdp
        model.save(update_fields=["devices", "fsdp"])
    return model


def trainable_model_delete(*, model: TrainableModel) -> None:
    """Delete the model (a 409 while runs use it), its checkpoints and, after commit, their files."""
    with transaction.atomic():
        model_files_remove_on_commit(model_ids=[model.pk])  # dropped if the delete is refused
        delete_unless_used(model, "model")
