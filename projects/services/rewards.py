"""Reward definitions: versioned grader specs, validated by the graders' registry on every write."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from projects.errors import ValidationFailed
from projects.grader_secrets import grader_for_storage, grader_urls_checked, grader_with_kept_headers
from projects.models import Project, RewardDefinition
from projects.services._common import check_slug, check_storable, create_unique, delete_unless_used
from training.rewards import GraderSpecError, validate_grader


def grader_problems(spec: Any, *, field: str) -> dict[str, Any]:
    """The normalised grader spec, or ValidationFailed listing every problem with its path under
    ``field`` (``spec.pattern``, ``grader.graders.fmt.operation``). An endpoint grader's URL must
    pass the operator's outbound policy (a 400 on ``<field>.url``)."""
    if not isinstance(spec, dict):
        raise ValidationFailed("must be a JSON object", field=field)
    check_storable(spec, field=field)  # no NaN, lone surrogate, NUL …: nothing a list cannot render
    try:
        return grader_urls_checked(validate_grader(spec), field=field)
    except GraderSpecError as exc:
        problems = []
        for problem in exc.problems:
            path = problem["path"].removeprefix("grader").lstrip(".")
            problems.append((f"{field}.{path}" if path else field, problem["message"]))
        message = "; ".join(f"{where}: {why}" for where, why in problems)
        raise ValidationFailed(
            message, field=problems[0][0] if problems else field, problems=problems
        ) from exc


def _grader(spec: Any) -> dict[str, Any]:
    return grader_problems(spec, field="spec")


def reward_definition_create(*, project: Project, name: str, spec: dict[str, Any]) -> RewardDefinition:
    check_slug(name, "name")
    normalised = grader_for_storage(_grader(spec))  # endpoint header values encrypted (grader_secrets)
    if RewardDefinition.objects.filter(project=project, name=name).exists():
        raise ValidationFailed(
            f"a reward definition named {name!r} exists; update it to add a version", field="name"
        )
    return create_unique(
        lambda: RewardDefinition.objects.create(project=project, name=name, version=1, spec=normalised),
        field="name",
        message=f"a reward definition named {name!r} already exists",
    )


def reward_definition_update(*, definition: RewardDefinition, spec: dict[str, Any]) -> RewardDefinition:
    """Insert the next version; runs keep the version they pinned. An endpoint grader's masked
    header values keep those of ``definition`` (the version that was read and edited)."""
    spec = grader_with_kept_headers(spec, stored=definition.spec, field="spec")
    normalised = grader_for_storage(_grader(spec))
    with transaction.atomic():
        latest = (
            RewardDefinition.objects.select_for_update()
            .filter(project=definition.project, name=definition.name)
            .order_by("-version")
            .first()
        )
        version = (latest.version if latest else 0) + 1
        return RewardDefinition.objects.create(
            project=definition.project, name=definition.name, version=version, spec=normalised
        )


def reward_definition_delete(*, definition: RewardDefinition) -> None:
    delete_unless_used(definition, "reward definition version")
