"""Scenario generation for a project: an LLM behind a team endpoint writes task rows for one of the
project's environments; the valid rows become a new task set whose ``source`` holds the report.

Bounded: at most ``training.rollouts.scenarios.MAX_ROWS`` rows, a few requests and ``GENERATION_DEADLINE_S``
seconds (each request also limited by the endpoint's own timeout). The API calls
``task_set_generate`` synchronously; the dashboard makes a ScenarioJob (``scenario_job_create``,
its input checked at once) that a worker runs (``scenarios.generate`` → ``scenario_job_run``),
recording rows accepted so far for the job's page.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from projects import secrets
from projects.errors import ValidationFailed
from projects.models import Environment, JudgeEndpoint, Project, ScenarioJob, ScenarioJobStatus, TaskSet
from projects.outbound import outbound_policy
from projects.services._common import check_slug
from projects.services.environments import environment_build
from projects.services.task_sets import parse_rows, task_set_create
from training.rollouts.remote import ChatEndpoint
from training.rollouts.scenarios import MAX_ROWS, ScenarioReport, generate_rows
from training.safety.slots import SlotsBusy

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


def environment_tool_schemas(*, environment: Environment, interactive: bool = False) -> list[dict[str, Any]]:
    """The tools the environment shows the model, as OpenAI schemas. Built through the registry
    (an MCP environment lists its server's tools, in its sandbox); when that fails, the stored
    definitions. A host with no free sandbox slot is SlotsBusy, not a fallback."""
    try:
        built = environment_build(environment=environment, interactive=interactive)
        try:
            return [tool.schema() for tool in built.tools]
        finally:
            close = getattr(built, "close", None)
            if close is not None:
                close()
    except SlotsBusy:
        raise
    except Exception:
        logger.warning(
            "environment %s: tools not built; using the stored definitions", environment.pk, exc_info=True
        )
        return [tool for tool in environment.tools if isinstance(tool, dict)]


def scenario_input_check(
    *,
    project: Project,
    environment: Environment,
    endpoint: JudgeEndpoint,
    name: str,
    instruction: str,
    n: int,
    model: str,
    validation_fraction: float,
) -> str:
    """What generation needs, checked before any request: one ValidationFailed listing every
    problem, each on its field (a form shows them all at once); the model to call (the endpoint's
    default when none is named)."""
    problems: list[tuple[str, str]] = []
    try:
        check_slug(name, "name")
    except ValidationFailed as exc:
        problems += exc.problems
    else:
        if TaskSet.objects.filter(project=project, name=name).exists():
            problems.append(("name", f"a task set named {name!r} already exists in this project"))
    if environment.project_id != project.id:
        problems.append(("environment", "must belong to the project"))
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ROWS:
        problems.append(("n", f"must be an integer from 1 to {MAX_ROWS}"))
    if not instruction.strip():
        problems.append(("instruction", "must not be empty"))
    elif len(instruction) > MAX_INSTRUCTION_CHARS:
        problems.append(("instruction", f"must be at most {MAX_INSTRUCTION_CHARS} characters"))
    if not 0.0 <= validation_fraction < 1.0:
        problems.append(("validation_fraction", "must be in [0, 1)"))
    model = model or endpoint.default_model
    if not model:
        problems.append(("model", "name the model to call (the endpoint has no default model)"))
    if problems:
        (field, message), *more = problems
        summary = "; ".join(f"{where}: {text}" for where, text in problems) if more else message
        raise ValidationFailed(summary, field=field, problems=problems)
    return model


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
    on_progress: Callable[[ScenarioReport], None] | None = None,
    interactive: bool = False,
) -> TaskSet:
    """Generate ``n`` rows and save the valid ones as task set ``name``; raises ValidationFailed
    (listing the per-row errors) when no row is valid. ``on_progress`` gets the report after each
    request to the endpoint."""
    model = scenario_input_check(
        project=project,
        environment=environment,
        endpoint=endpoint,
        name=name,
        instruction=instruction,
        n=n,
        model=model,
        validation_fraction=validation_fraction,
    )
    report = generate_rows(
        ChatEndpoint(
            base_url=endpoint.base_url,
            api_key=secrets.decrypt(endpoint.api_key_encrypted),
            timeout=min(endpoint.timeout_s, REQUEST_TIMEOUT_S),
            outbound=outbound_policy(),
        ),
        model,
        tools=environment_tool_schemas(environment=environment, interactive=interactive),
        instruction=instruction,
        n=n,
        validate=row_problems,
        environment=environment.kind,
        system_prompt=environment.system_prompt,
        deadline_s=GENERATION_DEADLINE_S,
        on_progress=on_progress,
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


# --- background jobs (the dashboard) ---------------------------------------------------------


def _enqueue_job(job_id: int) -> None:
    from projects.jobs.tasks import generate_scenarios

    transaction.on_commit(lambda: generate_scenarios.delay(job_id))


def scenario_job_create(
    *,
    project: Project,
    environment: Environment,
    endpoint: JudgeEndpoint,
    name: str,
    instruction: str,
    n: int,
    model: str = "",
    validation_fraction: float = 0.0,
    created_by: Any = None,
) -> ScenarioJob:
    """Queue a generation: the input is checked now (ValidationFailed on its field, nothing
    queued), the rows are asked for by a worker (``scenario_job_run``)."""
    model = scenario_input_check(
        project=project,
        environment=environment,
        endpoint=endpoint,
        name=name,
        instruction=instruction,
        n=n,
        model=model,
        validation_fraction=validation_fraction,
    )
    with transaction.atomic():
        job = ScenarioJob.objects.create(
            project=project,
            environment=environment,
            endpoint=endpoint,
            name=name,
            instruction=instruction,
            model=model,
            validation_fraction=validation_fraction,
            rows_total=n,
            created_by=created_by,
        )
        _enqueue_job(job.pk)
    return job


def _job_finish(job_id: int, **fields: Any) -> None:
    ScenarioJob.objects.filter(pk=job_id, status=ScenarioJobStatus.RUNNING).update(
        finished_at=timezone.now(), **fields
    )


def scenario_job_run(*, job_id: int, worker: str = "") -> str:
    """Run a queued job once: claim it (a conditional UPDATE, so a duplicate delivery is a
    no-op), generate with progress written after each request, end succeeded with the task set
    or failed with the reason (and, when no row was valid, the per-row errors)."""
    claimed = ScenarioJob.objects.filter(pk=job_id, status=ScenarioJobStatus.QUEUED).update(
        status=ScenarioJobStatus.RUNNING, started_at=timezone.now(), worker=worker, attempts=F("attempts") + 1
    )
    if not claimed:
        return "not claimed"
    job = ScenarioJob.objects.select_related("project", "environment", "endpoint").get(pk=job_id)
    if job.endpoint is None:
        _job_finish(
            job_id, status=ScenarioJobStatus.FAILED, error="the endpoint was deleted before the job ran"
        )
        return ScenarioJobStatus.FAILED

    def progress(report: ScenarioReport) -> None:
        ScenarioJob.objects.filter(pk=job_id).update(rows_done=report.accepted, requests_done=report.requests)

    try:
        task_set = task_set_generate(
            project=job.project,
            environment=job.environment,
            endpoint=job.endpoint,
            name=job.name,
            instruction=job.instruction,
            n=job.rows_total,
            model=job.model,
            validation_fraction=job.validation_fraction,
            on_progress=progress,
        )
    except ValidationFailed as exc:
        problems = [
            [where, message] for where, message in exc.problems if where.startswith(("rows[", "requests["))
        ]
        error = (
            exc.message if problems else "; ".join(f"{where}: {message}" for where, message in exc.problems)
        )
        _job_finish(job_id, status=ScenarioJobStatus.FAILED, error=error, problems=problems)
        return ScenarioJobStatus.FAILED
    except Exception as exc:  # the job must end readably, whatever broke
        logger.exception("scenario job %s failed", job_id)
        _job_finish(
            job_id, status=ScenarioJobStatus.FAILED, error=f"generation failed: {type(exc).__name__}: {exc}"
        )
        return ScenarioJobStatus.FAILED
    source = task_set.source or {}
    _job_finish(
        job_id,
        status=ScenarioJobStatus.SUCCEEDED,
        task_set=task_set,
        rows_done=source.get("accepted", task_set.row_count),
        requests_done=source.get("requests", 0),
    )
    return ScenarioJobStatus.SUCCEEDED
