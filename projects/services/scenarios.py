"""Scenario generation for a project: an LLM behind a team endpoint writes task rows for one of the
project's environments; the valid rows become a new task set whose ``source`` holds the report.

Synchronous by design, and bounded: at most ``training.scenarios.MAX_ROWS`` rows, a few requests
and ``GENERATION_DEADLINE_S`` seconds (each request also limited by the endpoint's own timeout), so
a web request never hangs on a slow model.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from django.db import transaction

from projects import secrets
from projects.errors import ValidationFailed
from projects.models import Environment, JudgeEndpoint, Project, TaskSet
from projects.outbound import outbound_policy
from projects.services._common import check_slug
from projects.services.environments import environment_build
from projects.services.task_sets import parse_rows, task_set_create
from training.remote import ChatEndpoint
from training.scenarios import MAX_ROWS, generate_rows

logger = logging.getLogger(__name__)

GENERATION_DEADLINE_S = 120.0
REQUEST_TIMEOUT_S = 60.0
MAX_INSTRUCTION_CHARS = 4000


def row_problems(row: Any) -> list[tuple[str, str]]:
    """A generated row checked by the upload rules (``projects.services.task_sets``): [(field, message)]."""
    try:
        parse_rows(rows=[copy.deepcopy(row)])
    except ValidationFailed as exc:
        return [
            (where.removeprefix("line 1").lstrip(":").strip(), message) for where, message in exc.problems
        ]
    return []


def environment_tool_schemas(*, environment: Environment) -> list[dict[str, Any]]:
    """The tools the environment shows the model, as OpenAI schemas. Built through the registry
    (an MCP environment lists its server's tools); when that fails, the stored definitions."""
    try:
        built = environment_build(environment=environment)
        try:
            return [tool.schema() for tool in built.tools]
        finally:
            close = getattr(built, "close", None)
            if close is not None:
                close()
    except Exception:
        logger.warning(
            "environment %s: tools not built; using the stored definitions", environment.pk, exc_info=True
        )
        return [tool for tool in environment.tools if isinstance(tool, dict)]


def task_set_generate(
    *,
    project: Project,
    environment: Environment,
    endpoint: JudgeEndpoint,
    name: str,
    instruction: str,
    n: int,
    model: str = "",
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> TaskSet:
    """Generate ``n`` rows and save the valid ones as task set ``name``; raises ValidationFailed
    (listing the per-row errors) when no row is valid."""
    check_slug(name, "name")
    if environment.project_id != project.id:
        raise ValidationFailed("must belong to the project", field="environment")
    if TaskSet.objects.filter(project=project, name=name).exists():
        raise ValidationFailed(f"a task set named {name!r} already exists in this project", field="name")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ROWS:
        raise ValidationFailed(f"must be an integer from 1 to {MAX_ROWS}", field="n")
    if not instruction.strip():
        raise ValidationFailed("must not be empty", field="instruction")
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        raise ValidationFailed(f"must be at most {MAX_INSTRUCTION_CHARS} characters", field="instruction")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValidationFailed("must be in [0, 1)", field="validation_fraction")
    model = model or endpoint.default_model
    if not model:
        raise ValidationFailed("name the model to call (the endpoint has no default model)", field="model")
    report = generate_rows(
        ChatEndpoint(
            base_url=endpoint.base_url,
            api_key=secrets.decrypt(endpoint.api_key_encrypted),
            timeout=min(endpoint.timeout_s, REQUEST_TIMEOUT_S),
            outbound=outbound_policy(),
        ),
        model,
        tools=environment_tool_schemas(environment=environment),
        instruction=instruction,
        n=n,
        validate=row_problems,
        environment=environment.kind,
        system_prompt=environment.system_prompt,
        deadline_s=GENERATION_DEADLINE_S,
    )
    source = {
        "type": "generated",
        "endpoint": endpoint.name,
        "environment": environment.pk,
        "instruction": instruction,
        **report.to_dict(),
    }
    if not report.rows:
        problems = [
            (f"rows[{e.request}.{e.row}]" if e.row is not None else f"requests[{e.request}]", e.error)
            for e in report.errors[:20]
        ]
        field = "endpoint" if all(e.row is None for e in report.errors) else "instruction"
        first = report.errors[0].error if report.errors else "no rows"
        raise ValidationFailed(
            f"the model wrote no valid task rows ({len(report.errors)} errors; first: {first})",
            field=field,
            problems=problems or None,
        )
    with transaction.atomic():
        task_set = task_set_create(
            project=project, name=name, rows=report.rows, validation_fraction=validation_fraction, seed=seed
        )
        task_set.source = source
        task_set.save(update_fields=["source"])
    return task_set
