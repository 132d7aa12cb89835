"""Writes. Every change to the domain goes through a function here (keyword-only, typed).

Concurrency invariants:
- A run changes status only in ``run_transition`` under ``select_for_update``, following
  ``ALLOWED_TRANSITIONS``, and every transition inserts a RunEvent in the same transaction.
- Training work is enqueued with ``transaction.on_commit``, so a worker never sees a run that the
  web process has not committed.
- A step (metrics, trajectories, checkpoint row) is recorded in one transaction after the
  checkpoint files are complete; the (run, step) unique constraint makes a replay a no-op.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from projects import environment_config
from projects.errors import Conflict, DomainError, Forbidden, InvalidTransition, NotFound, ValidationFailed
from projects.models import (
    ApiKey,
    BaseModel,
    Checkpoint,
    Environment,
    EnvironmentKind,
    EventLevel,
    EventType,
    Membership,
    Project,
    RewardDefinition,
    Role,
    Run,
    RunEvent,
    RunStatus,
    StepMetrics,
    TaskRow,
    TaskSet,
    Team,
    TrainableModel,
    Trajectory,
    slug_validator,
)
from projects.tasksets import assign_splits, parse_rows
from training.config import ConfigError, LoraSpec, TrainConfig
from training.rewards import GraderSpecError, validate_grader

# --- helpers --------------------------------------------------------------------------------


def check_slug(value: str, field: str) -> None:
    """A name users put in URLs and model ids (``project/model:step``): ValidationFailed on ``field``
    unless it is a slug. Shared by every service that names things (scenarios too)."""
    from django.core.exceptions import ValidationError

    try:
        slug_validator(value)
    except ValidationError as exc:
        raise ValidationFailed(exc.messages[0], field=field) from exc


def _unique(create, *, field: str, message: str):
    """Run a create inside a savepoint, turning a unique-constraint race into a clear 400."""
    try:
        with transaction.atomic():
            return create()
    except IntegrityError as exc:
        raise ValidationFailed(message, field=field) from exc


# --- teams, members, keys -------------------------------------------------------------------


def team_create(*, name: str, owner: User | None = None) -> Team:
    check_slug(name, "name")
    if Team.objects.filter(name=name).exists():
        raise ValidationFailed(f"a team named {name!r} already exists", field="name")
    with transaction.atomic():
        team = _unique(lambda: Team.objects.create(name=name), field="name", message="team name taken")
        if owner is not None:
            Membership.objects.create(team=team, user=owner, role=Role.OWNER)
    return team


# A team always keeps at least one owner: demoting or removing one first locks the team's owner
# memberships (select_for_update), so two owners leaving at once are serialised and the second
# sees that it would be the last.
LAST_OWNER = "last_owner"


def _require_owner(*, team: Team, by: User | None) -> None:
    """``by`` is the person acting; None means the platform itself (set-up commands, tests)."""
    if by is not None and not Membership.objects.filter(team=team, user=by, role=Role.OWNER).exists():
        raise Forbidden("only team owners manage members")


def _refuse_last_owner(*, team: Team, user: User, action: str) -> None:
    owners = list(
        Membership.objects.select_for_update()
        .filter(team=team, role=Role.OWNER)
        .values_list("user_id", flat=True)
    )
    if owners == [user.pk]:
        raise DomainError(
            f"{user.username} is the last owner of {team.name} and cannot be {action}; "
            "make another member an owner first",
            field="user",
            code=LAST_OWNER,
        )


def membership_set(*, team: Team, user: User, role: str, by: User | None = None) -> Membership:
    """Add ``user`` to ``team`` with ``role``, or change their role (owners only, when ``by`` is
    given). The last owner cannot be demoted."""
    if role not in Role.values:
        raise ValidationFailed(f"must be one of {', '.join(Role.values)}", field="role")
    with transaction.atomic():
        _require_owner(team=team, by=by)
        if role != Role.OWNER:
            _refuse_last_owner(team=team, user=user, action="demoted")
        membership, _ = Membership.objects.update_or_create(team=team, user=user, defaults={"role": role})
    return membership


def membership_remove(*, team: Team, user: User, by: User | None) -> None:
    """Take ``user`` out of ``team`` (owners only, when ``by`` is given; an owner may remove
    themselves while another owner remains). The last owner cannot be removed."""
    with transaction.atomic():
        _require_owner(team=team, by=by)
        membership = Membership.objects.select_for_update().filter(team=team, user=user).first()
        if membership is None:
            raise NotFound(f"{user.username} is not a member of {team.name}", field="user")
        if membership.role == Role.OWNER:
            _refuse_last_owner(team=team, user=user, action="removed")
        membership.delete()


API_KEY_PREFIX = "aw"


def _hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class CreatedApiKey:
    api_key: ApiKey
    plaintext: str  # shown once, never stored


def api_key_create(
    *, team: Team, name: str, read_only: bool = False, created_by: User | None = None
) -> CreatedApiKey:
    if not name.strip():
        raise ValidationFailed("must not be empty", field="name")
    prefix = secrets.token_hex(6)
    plaintext = f"{API_KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    api_key = ApiKey.objects.create(
        team=team,
        name=name.strip()[:100],
        prefix=prefix,
        key_hash=_hash_key(plaintext),
        read_only=read_only,
        created_by=created_by,
    )
    return CreatedApiKey(api_key=api_key, plaintext=plaintext)


_LAST_USED_RESOLUTION = timedelta(seconds=60)


def api_key_authenticate(*, raw: str) -> ApiKey | None:
    """Return the active key matching ``raw`` or None. Updates ``last_used_at`` at most once a
    minute so authentication does not write on every request."""
    parts = raw.split("_", 2)
    if len(parts) != 3 or parts[0] != API_KEY_PREFIX:
        return None
    api_key = ApiKey.objects.select_related("team").filter(prefix=parts[1], revoked_at__isnull=True).first()
    if api_key is None or not hmac.compare_digest(api_key.key_hash, _hash_key(raw)):
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > _LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
        api_key.last_used_at = now
    return api_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


# --- projects and their resources -----------------------------------------------------------


def project_create(*, team: Team, name: str, description: str = "") -> Project:
    check_slug(name, "name")
    return _unique(
        lambda: Project.objects.create(team=team, name=name, description=description),
        field="name",
        message=f"a project named {name!r} already exists in this team",
    )


def project_update(*, project: Project, name: str | None = None, description: str | None = None) -> Project:
    if name is not None:
        check_slug(name, "name")
        project.name = name
    if description is not None:
        project.description = description
    _unique(project.save, field="name", message=f"a project named {name!r} already exists in this team")
    return project


def _delete(instance: Any, what: str) -> None:
    from django.db.models import ProtectedError

    try:
        instance.delete()
    except ProtectedError as exc:
        raise Conflict(f"this {what} is used by runs; delete those first", code="in_use") from exc


def project_delete(*, project: Project) -> None:
    if project.runs.filter(status__in=ACTIVE_STATUSES).exists():
        raise Conflict("the project has active runs; cancel them first", code="in_use")
    with transaction.atomic():
        # Runs protect their inputs; deleting a project deletes its runs first, then the rest.
        Run.objects.filter(project=project).delete()
        _delete(project, "project")


def base_model_register(*, name: str, source: str, description: str = "") -> BaseModel:
    if not name.strip():
        raise ValidationFailed("must not be empty", field="name")
    if not source.strip():
        raise ValidationFailed("must not be empty", field="source")
    model, _ = BaseModel.objects.update_or_create(
        name=name, defaults={"source": source, "description": description}
    )
    return model


def _lora(lora: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return LoraSpec.from_dict(lora or {}).to_dict()
    except ConfigError as exc:
        raise ValidationFailed(exc.message, field=f"lora.{exc.field}") from exc


def trainable_model_create(
    *, project: Project, name: str, base_model: BaseModel, lora: dict[str, Any] | None = None
) -> TrainableModel:
    check_slug(name, "name")
    spec = _lora(lora)
    return _unique(
        lambda: TrainableModel.objects.create(project=project, name=name, base_model=base_model, lora=spec),
        field="name",
        message=f"a model named {name!r} already exists in this project",
    )


def trainable_model_update(*, model: TrainableModel, lora: dict[str, Any] | None = None) -> TrainableModel:
    if lora is not None:
        if model.checkpoints.exists():
            raise Conflict("the LoRA shape cannot change once the model has checkpoints", code="in_use")
        model.lora = _lora(lora)
        model.save(update_fields=["lora"])
    return model


def trainable_model_delete(*, model: TrainableModel) -> None:
    _delete(model, "model")


def grader_problems(spec: Any, *, field: str) -> dict[str, Any]:
    """The normalised grader spec, or ValidationFailed listing every problem with its path under
    ``field`` (``spec.pattern``, ``grader.graders.fmt.operation``)."""
    if not isinstance(spec, dict):
        raise ValidationFailed("must be a JSON object", field=field)
    try:
        return validate_grader(spec)
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
    normalised = _grader(spec)
    if RewardDefinition.objects.filter(project=project, name=name).exists():
        raise ValidationFailed(
            f"a reward definition named {name!r} exists; update it to add a version", field="name"
        )
    return _unique(
        lambda: RewardDefinition.objects.create(project=project, name=name, version=1, spec=normalised),
        field="name",
        message=f"a reward definition named {name!r} already exists",
    )


def reward_definition_update(*, definition: RewardDefinition, spec: dict[str, Any]) -> RewardDefinition:
    """Insert the next version; runs keep the version they pinned."""
    normalised = _grader(spec)
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
    _delete(definition, "reward definition version")


def task_set_create(
    *,
    project: Project,
    name: str,
    jsonl: str | None = None,
    rows: list[Any] | None = None,
    validation_fraction: float = 0.0,
    seed: int = 0,
) -> TaskSet:
    check_slug(name, "name")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValidationFailed("must be in [0, 1)", field="validation_fraction")
    parsed = parse_rows(jsonl=jsonl, rows=rows)
    splits = assign_splits(parsed, validation_fraction=validation_fraction, seed=seed)
    if "train" not in splits:
        raise ValidationFailed("the task set needs at least one training row", field="validation_fraction")
    with transaction.atomic():
        task_set = _unique(
            lambda: TaskSet.objects.create(
                project=project,
                name=name,
                row_count=len(parsed),
                train_count=splits.count("train"),
                validation_count=splits.count("validation"),
            ),
            field="name",
            message=f"a task set named {name!r} already exists in this project",
        )
        TaskRow.objects.bulk_create(
            [
                TaskRow(task_set=task_set, index=i, split=split, data=row.data)
                for i, (row, split) in enumerate(zip(parsed, splits, strict=True))
            ],
            batch_size=500,
        )
    return task_set


def task_set_delete(*, task_set: TaskSet) -> None:
    _delete(task_set, "task set")


_SAMPLING_KEYS = {"temperature", "top_p", "max_new_tokens", "stop"}


def _environment_fields(
    kind: str,
    system_prompt: str,
    max_turns: int | None,
    tools: Any,
    sampling: Any,
    config: Any = None,
    tool_timeout_s: Any = 10.0,
    stored_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every field checked by the environment registry's per-kind rules (training.environments):
    `max_turns=None` takes the kind's default; errors name the field (`config.<key>`, `tools`).
    MCP header values: masked ones keep `stored_config`'s (see projects.environment_config); the
    registry checks the plaintext, the returned config holds them encrypted."""
    from training.environments import validate_environment

    if kind not in EnvironmentKind.values:
        raise ValidationFailed(f"must be one of {', '.join(EnvironmentKind.values)}", field="kind")
    config = environment_config.config_with_kept_headers(config, stored=stored_config or {})
    try:
        checked = validate_environment(
            kind,
            config=config,
            tools=tools,
            max_turns=max_turns,
            tool_timeout_s=tool_timeout_s,
            allowed_programs=environment_config.mcp_allowed_programs(),
        )
    except ConfigError as exc:
        raise ValidationFailed(exc.message, field=exc.field) from exc
    if not isinstance(sampling, dict):
        raise ValidationFailed("must be an object", field="sampling")
    for key in sampling:
        if key not in _SAMPLING_KEYS:
            raise ValidationFailed(
                f"unknown key (allowed: {', '.join(sorted(_SAMPLING_KEYS))})", field=f"sampling.{key}"
            )
    stop = sampling.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValidationFailed("must be a list of non-empty strings", field="sampling.stop")
    overrides = {k: v for k, v in sampling.items() if k != "stop"}
    try:
        TrainConfig.from_dict(overrides)
    except ConfigError as exc:
        raise ValidationFailed(exc.message, field=f"sampling.{exc.field}") from exc
    return {
        "kind": kind,
        "system_prompt": system_prompt,
        "max_turns": checked["max_turns"],
        "tools": checked["tools"],
        "config": environment_config.config_for_storage(checked["config"]),
        "tool_timeout_s": float(tool_timeout_s),
        "sampling": sampling,
    }


def environment_create(
    *,
    project: Project,
    name: str,
    kind: str = EnvironmentKind.CHAT,
    system_prompt: str = "",
    max_turns: int | None = None,
    tools: Any = None,
    sampling: Any = None,
    config: Any = None,
    tool_timeout_s: float = 10.0,
) -> Environment:
    check_slug(name, "name")
    fields = _environment_fields(
        kind, system_prompt, max_turns, tools or [], sampling or {}, config or {}, tool_timeout_s
    )
    return _unique(
        lambda: Environment.objects.create(project=project, name=name, **fields),
        field="name",
        message=f"an environment named {name!r} already exists in this project",
    )


def environment_update(*, environment: Environment, **changes: Any) -> Environment:
    current = {
        "kind": environment.kind,
        "system_prompt": environment.system_prompt,
        "max_turns": environment.max_turns,
        "tools": environment.tools,
        "sampling": environment.sampling,
        # As the API shows it: masked header values, which keep the stored ones.
        "config": environment_config.config_public(environment.config),
        "tool_timeout_s": environment.tool_timeout_s,
    }
    stored_config = environment.config
    if changes.get("kind", environment.kind) != environment.kind:
        # Another kind: its own defaults, unless given (a chat's one turn is no game of tic-tac-toe).
        current.update(max_turns=None, tools=[], config={})
        stored_config = {}
    current.update({k: v for k, v in changes.items() if k in current})
    for key, value in _environment_fields(**current, stored_config=stored_config).items():
        setattr(environment, key, value)
    environment.save()
    return environment


def environment_delete(*, environment: Environment) -> None:
    _delete(environment, "environment")


# --- runs -----------------------------------------------------------------------------------

ACTIVE_STATUSES = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)
TERMINAL_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)

# The whole run state machine. ``running → running`` is a worker re-claiming an orphaned run.
ALLOWED_TRANSITIONS: dict[str, set[str]] = {
    RunStatus.QUEUED: {RunStatus.RUNNING, RunStatus.CANCELLED, RunStatus.FAILED},
    RunStatus.RUNNING: {
        RunStatus.RUNNING,
        RunStatus.PAUSED,
        RunStatus.SUCCEEDED,
        RunStatus.FAILED,
        RunStatus.CANCELLED,
    },
    RunStatus.PAUSED: {RunStatus.QUEUED, RunStatus.CANCELLED, RunStatus.FAILED},
    RunStatus.SUCCEEDED: set(),
    RunStatus.FAILED: set(),
    RunStatus.CANCELLED: set(),
}


def run_event_add(
    *,
    run: Run,
    message: str,
    level: str = EventLevel.INFO,
    type: str = EventType.MESSAGE,
    data: dict | None = None,
) -> RunEvent:
    return RunEvent.objects.create(run=run, message=message, level=level, type=type, data=data or {})


def run_transition(
    *,
    run_id: int,
    to: str,
    message: str,
    level: str = EventLevel.INFO,
    data: dict[str, Any] | None = None,
    updates: dict[str, Any] | None = None,
) -> Run:
    """Move a run to ``to`` if the state machine allows it, recording an event. Raises
    InvalidTransition otherwise (callers that race, like cancel, catch it)."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        if to not in ALLOWED_TRANSITIONS[run.status]:
            raise InvalidTransition(f"a {run.status} run cannot become {to}", field="status")
        previous = run.status
        run.status = to
        now = timezone.now()
        if to in TERMINAL_STATUSES:
            run.finished_at = now
        for key, value in (updates or {}).items():
            setattr(run, key, value)
        run.save()
        run_event_add(
            run=run,
            message=message,
            level=level,
            data={"from": previous, "to": to, **(data or {})},
        )
    return run


def _enqueue_run(run_id: int) -> None:
    from training.tasks import train_run

    transaction.on_commit(lambda: train_run.delay(run_id))


def run_create(
    *,
    model: TrainableModel,
    task_set: TaskSet,
    environment: Environment,
    reward: RewardDefinition,
    config: dict[str, Any] | None = None,
    created_by: User | None = None,
) -> Run:
    project = model.project
    for field, obj in (("task_set", task_set), ("environment", environment), ("reward", reward)):
        if obj.project_id != project.id:
            raise ValidationFailed("must belong to the same project as the model", field=field)
    if task_set.train_count == 0:
        raise ValidationFailed("the task set has no training rows", field="task_set")
    merged = {k: v for k, v in environment.sampling.items() if k != "stop"}
    merged.update(config or {})
    try:
        train_config = TrainConfig.from_dict(merged)
    except ConfigError as exc:
        raise ValidationFailed(exc.message, field=f"config.{exc.field}") from exc
    with transaction.atomic():
        # Lock the model row so two concurrent creates cannot both see "no active run".
        TrainableModel.objects.select_for_update().get(pk=model.pk)
        if Run.objects.filter(model=model, status__in=ACTIVE_STATUSES).exists():
            raise Conflict("this model already has an active run; cancel it or wait", code="model_busy")
        run = Run.objects.create(
            project=project,
            model=model,
            task_set=task_set,
            environment=environment,
            reward=reward,
            config=train_config.to_dict(),
            total_steps=train_config.steps,
            created_by=created_by,
        )
        run_event_add(run=run, message=f"Run created: {train_config.steps} steps on model {model.name}")
        _enqueue_run(run.id)
    return run


def run_cancel(*, run: Run) -> Run:
    """Queued runs are cancelled at once; a running run stops before its next step."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status in TERMINAL_STATUSES:
            raise InvalidTransition(f"the run already {locked.status}", field="status")
        if locked.status == RunStatus.RUNNING:
            if not locked.cancel_requested:
                locked.cancel_requested = True
                locked.save(update_fields=["cancel_requested"])
                run_event_add(
                    run=locked, message="Cancellation requested; the run stops before its next step"
                )
            return locked
    return run_transition(run_id=run.pk, to=RunStatus.CANCELLED, message="Run cancelled before it started")


def run_claim(*, run_id: int, worker: str, stale_after_s: float | None = None) -> Run | None:
    """The idempotent first act of the training task.

    Returns the run if this worker now owns it: it was queued, or it is running but its worker has
    not sent a heartbeat for ``stale_after_s`` (died). Otherwise (a duplicate delivery, a finished or
    cancelled run, a live owner) returns None and changes nothing.
    """
    stale_after = timedelta(
        seconds=stale_after_s if stale_after_s is not None else settings.RUN_HEARTBEAT_TIMEOUT_S
    )
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None:
            return None
        now = timezone.now()
        if run.status == RunStatus.QUEUED:
            if run.cancel_requested:
                return None
            message = f"Run started on worker {worker}"
        elif run.status == RunStatus.RUNNING and (
            run.heartbeat_at is None or now - run.heartbeat_at > stale_after
        ):
            message = f"Worker {run.worker or '?'} stopped sending heartbeats; resuming on {worker} from step {run.current_step}"
        else:
            return None
        updates = {"worker": worker, "heartbeat_at": now, "attempts": run.attempts + 1}
        if run.started_at is None:
            updates["started_at"] = now
        return run_transition(run_id=run.pk, to=RunStatus.RUNNING, message=message, updates=updates)


def run_heartbeat(*, run_id: int, worker: str) -> bool:
    """Refresh the heartbeat; False if this worker no longer owns the run (it must stop)."""
    updated = Run.objects.filter(pk=run_id, worker=worker, status=RunStatus.RUNNING).update(
        heartbeat_at=timezone.now()
    )
    return updated == 1


def run_set_start_step(*, run: Run, start_step: int) -> Run:
    Run.objects.filter(pk=run.pk).update(start_step=start_step, current_step=start_step)
    run.start_step = run.current_step = start_step
    return run


def checkpoint_record(
    *, model: TrainableModel, run: Run | None, step: int, path: str, metrics: dict[str, Any] | None = None
) -> Checkpoint:
    """Record a checkpoint whose files are already complete on disk (idempotent per step)."""
    checkpoint, _ = Checkpoint.objects.get_or_create(
        model=model, step=step, defaults={"run": run, "path": path, "metrics": metrics or {}}
    )
    return checkpoint


@dataclass
class TrajectoryRecord:
    group_index: int
    sample_index: int
    task_row_index: int | None
    messages: list[dict[str, Any]]
    reward: float
    sub_rewards: dict[str, float]
    errors: list[dict[str, Any]]
    metrics: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def jsonb_safe(value: Any) -> Any:
    """PostgreSQL text and jsonb cannot hold NUL characters, but a model can sample one: replace it
    (U+FFFD) rather than lose the whole step."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {jsonb_safe(k): jsonb_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonb_safe(v) for v in value]
    return value


def step_record(
    *,
    run: Run,
    worker: str,
    step: int,
    metrics: dict[str, Any],
    trajectories: list[TrajectoryRecord],
    checkpoint_path: str,
) -> bool:
    """Record one finished step in one transaction. Returns False (and writes nothing) if the step
    is already recorded or this worker lost the run: a step is never counted twice."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.status != RunStatus.RUNNING or locked.worker != worker:
            return False
        if StepMetrics.objects.filter(run=locked, step=step).exists():
            return False
        StepMetrics.objects.create(
            run=locked,
            step=step,
            reward_mean=metrics.get("reward_mean"),
            reward_std=metrics.get("reward_std"),
            loss=metrics.get("loss"),
            metrics=metrics,
        )
        Trajectory.objects.bulk_create(
            [Trajectory(run=locked, step=step, **jsonb_safe(record.__dict__)) for record in trajectories],
            batch_size=200,
        )
        checkpoint_record(model=locked.model, run=locked, step=step, path=checkpoint_path, metrics=metrics)
        locked.current_step = step
        locked.heartbeat_at = timezone.now()
        locked.save(update_fields=["current_step", "heartbeat_at"])
        run_event_add(
            run=locked,
            message=f"Step {step - locked.start_step}/{locked.total_steps}: reward {metrics.get('reward_mean', 0):.3f}, loss {metrics.get('loss', 0):.4f}",
            type=EventType.METRICS,
            data={"step": step, **metrics},
        )
    return True


def run_fail(*, run_id: int, error: str) -> Run | None:
    message = error if len(error) <= 2000 else error[:2000] + "…"
    try:
        return run_transition(
            run_id=run_id,
            to=RunStatus.FAILED,
            message=f"Run failed: {message}",
            level=EventLevel.ERROR,
            updates={"error": message},
        )
    except InvalidTransition:
        return None


def runs_requeue_orphaned(*, stale_after_s: float | None = None) -> list[int]:
    """Re-enqueue running runs whose worker stopped heartbeating; the claim decides who resumes."""
    stale_after = stale_after_s if stale_after_s is not None else settings.RUN_HEARTBEAT_TIMEOUT_S
    cutoff = timezone.now() - timedelta(seconds=stale_after)
    run_ids = list(
        Run.objects.filter(status=RunStatus.RUNNING, heartbeat_at__lt=cutoff).values_list("id", flat=True)
    )
    for run_id in run_ids:
        _enqueue_run(run_id)
    return run_ids
