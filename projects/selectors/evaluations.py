"""Reads of evaluations, every one scoped to the caller's team: lists, samples and events; the
rows an evaluation runs on; and the one resolution of an evaluation request's subject and
reference (model ids, checkpoints, base models, team endpoints) that the API and the dashboard
share, with the labels both show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Max, Q, QuerySet

from projects.errors import NotFound, ValidationFailed
from projects.models import (
    BaseModel,
    Checkpoint,
    Environment,
    Evaluation,
    EvaluationEvent,
    EvaluationSample,
    EvaluationStatus,
    JudgeEndpoint,
    RewardDefinition,
    Run,
    TaskSet,
    Team,
)
from projects.selectors._scoping import scoped, scoped_reference
from projects.selectors.fine_tuning import job_latest_checkpoint
from projects.selectors.serving import resolve_model
from projects.selectors.task_sets import task_set_rows
from training.export import model_card


def evaluations_list(
    *,
    team: Team,
    project_id: int | None = None,
    run_id: int | None = None,
    checkpoint_id: int | None = None,
    status: str | None = None,
) -> QuerySet[Evaluation]:
    evaluations = scoped(Evaluation, team).select_related("checkpoint__model__project", "base_model")
    if project_id is not None:
        evaluations = evaluations.filter(project_id=project_id)
    if run_id is not None:
        evaluations = evaluations.filter(run_id=run_id)
    if checkpoint_id is not None:
        evaluations = evaluations.filter(checkpoint_id=checkpoint_id)
    if status is not None:
        evaluations = evaluations.filter(status=status)
    return evaluations.order_by("-id")


def evaluation_passes(*, evaluation: Evaluation) -> dict[str, Any]:
    """How the model's samples stand against the evaluation's pass threshold: ``n`` samples,
    ``passed`` (reward ≥ threshold) and the ``best`` reward (None without samples); a pass rate
    of 0 reads differently when the best reward is 0.5 than when it is 0.99."""
    counts = EvaluationSample.objects.filter(evaluation=evaluation, side="subject").aggregate(
        n=Count("id"), passed=Count("id", filter=Q(reward__gte=evaluation.pass_threshold)), best=Max("reward")
    )
    return {"n": counts["n"], "passed": counts["passed"], "best": counts["best"]}


def evaluation_get(*, team: Team, evaluation_id: int) -> Evaluation:
    evaluation = scoped(Evaluation, team).filter(pk=evaluation_id).first()
    if evaluation is None:
        raise NotFound("evaluation not found")
    return evaluation


def run_evaluations(*, run: Run) -> QuerySet[Evaluation]:
    return Evaluation.objects.filter(run=run).select_related("checkpoint").order_by("step", "id")


def checkpoint_evaluations(*, checkpoint: Checkpoint) -> QuerySet[Evaluation]:
    return Evaluation.objects.filter(checkpoint=checkpoint).order_by("-id")


def run_step_evaluated(*, run: Run, step: int) -> bool:
    """Whether the run's checkpoint ``step`` has its validation evaluation (a resumed run asks, to
    evaluate a step whose worker died between recording it and evaluating it)."""
    return Evaluation.objects.filter(run=run, step=step).exists()


def evaluation_is_active(*, evaluation_id: int, worker: str) -> bool:
    """Whether this worker should go on (not cancelled, not taken over)."""
    return Evaluation.objects.filter(
        pk=evaluation_id, status=EvaluationStatus.RUNNING, worker=worker
    ).exists()


def evaluation_rows(*, evaluation: Evaluation) -> list[dict[str, Any]]:
    """The rows an evaluation runs on: its split, the first ``max_rows`` by index."""
    return task_set_rows(task_set=evaluation.task_set, split=evaluation.split, max_rows=evaluation.max_rows)


# --- samples and events -----------------------------------------------------------------------


def evaluation_samples(*, evaluation: Evaluation, side: str | None = None) -> QuerySet[EvaluationSample]:
    samples = EvaluationSample.objects.filter(evaluation=evaluation)
    if side:
        samples = samples.filter(side=side)
    return samples.order_by("side", "task_row_index", "sample_index")


def evaluation_sample_row_indexes(*, evaluation: Evaluation) -> list[int]:
    """The task rows an evaluation has samples for, in order (the samples view pages by row)."""
    return list(
        EvaluationSample.objects.filter(evaluation=evaluation)
        .values_list("task_row_index", flat=True)
        .distinct()
        .order_by("task_row_index")
    )


def evaluation_samples_of_rows(
    *, evaluation: Evaluation, row_indexes: list[int]
) -> QuerySet[EvaluationSample]:
    return EvaluationSample.objects.filter(evaluation=evaluation, task_row_index__in=row_indexes).order_by(
        "task_row_index", "side", "sample_index"
    )


def evaluation_recent_events(*, evaluation: Evaluation, limit: int = 50) -> list[EvaluationEvent]:
    """The newest ``limit`` events, newest first (the evaluation page's log)."""
    return list(EvaluationEvent.objects.filter(evaluation=evaluation).order_by("-id")[:limit])


# --- subject and reference ----------------------------------------------------------------------


def model_id_resolve(*, team: Team, model_id: Any, field: str) -> tuple[Checkpoint | None, BaseModel | None]:
    """A model id as the gateway reads it (``project/model:step``, ``:latest``, a base model name)
    → (checkpoint, None) or (None, base model); unknown or another team's → 400 on ``field``."""
    if not isinstance(model_id, str) or not model_id.strip():
        raise ValidationFailed(
            "must be a model id such as project/model:step or a base model name", field=field
        )
    try:
        target = resolve_model(team=team, model_id=model_id.strip())
    except NotFound:
        raise ValidationFailed(
            f"no checkpoint or base model {model_id!r} in your team", field=field
        ) from None
    return target.checkpoint, (None if target.checkpoint else target.base_model)


def model_label(checkpoint: Checkpoint | None, base_model: BaseModel | None) -> str:
    """A checkpoint's model id (``project/model:step``) or the base model's name."""
    if checkpoint is not None:
        return f"{checkpoint.model.project.name}/{checkpoint.model.name}:{checkpoint.step}"
    return base_model.name if base_model is not None else ""


def evaluation_results_summary(results: dict[str, Any]) -> str:
    """An evaluation's results in one line, for its events and the run's."""

    def show(value: Any) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    threshold = results.get("pass_threshold")
    at = f", reward ≥ {threshold:g}" if isinstance(threshold, int | float) else ""
    text = f"reward {show(results.get('reward_mean'))}, pass rate {show(results.get('pass_rate'))} (n={results.get('n')}{at})"
    comparison = results.get("comparison")
    if comparison:
        text += f"; win rate vs reference {show(comparison.get('win_rate'))}"
    baseline = results.get("comparison_to_baseline")
    if baseline:
        text += f"; win rate vs step {results.get('baseline_step')} {show(baseline.get('win_rate'))}"
    return text


@dataclass(frozen=True)
class ModelChoice:
    """An evaluation's subject or reference as a request names it: one of a checkpoint id, a model
    id as the gateway reads it, a base model id, or (a reference only) a team endpoint id with the
    model to call there (empty: the endpoint's default). Empty values count as not given."""

    checkpoint: Any = None
    model_id: Any = None
    base_model: Any = None
    endpoint: Any = None
    endpoint_model: str = ""

    def given(self) -> list[str]:
        return [
            name
            for name in ("checkpoint", "model_id", "base_model", "endpoint")
            if getattr(self, name) not in (None, "")
        ]


def _model_choice_resolve(
    team: Team, choice: ModelChoice, *, prefix: str
) -> tuple[Checkpoint | None, BaseModel | None]:
    if choice.checkpoint not in (None, ""):
        return scoped_reference(Checkpoint, team, choice.checkpoint, field=f"{prefix}checkpoint"), None
    if choice.model_id not in (None, ""):
        return model_id_resolve(team=team, model_id=choice.model_id, field=f"{prefix}model")
    base_model = BaseModel.objects.filter(pk=choice.base_model).first()
    if base_model is None:
        raise ValidationFailed(f"no base model with id {choice.base_model}", field=f"{prefix}base_model")
    return None, base_model


def _reference_resolve(team: Team, choice: ModelChoice | None) -> dict[str, Any]:
    if choice is None:
        return {}
    given = choice.given()
    if "endpoint" in given:
        if len(given) > 1:
            raise ValidationFailed("give an endpoint with a model name, or a checkpoint", field="reference")
        return {
            "reference_endpoint": scoped_reference(
                JudgeEndpoint, team, choice.endpoint, field="reference.endpoint"
            ),
            "reference_model": choice.endpoint_model or "",
        }
    if len(given) != 1:
        raise ValidationFailed(
            "give exactly one of checkpoint, model, or endpoint (+ model)", field="reference"
        )
    checkpoint, base_model = _model_choice_resolve(team, choice, prefix="reference.")
    return {"reference_checkpoint": checkpoint, "reference_base_model": base_model}


def evaluation_inputs_resolve(
    *,
    team: Team,
    subject: ModelChoice,
    task_set: Any,
    environment: Any,
    reward: Any,
    reference: ModelChoice | None = None,
) -> dict[str, Any]:
    """The rows an evaluation request names, as ``services.evaluation_create`` takes them
    (``task_set``, ``environment``, ``reward``, ``checkpoint`` or ``base_model``, the
    ``reference_*`` fields). Ids of another team's rows, unknown model ids and a malformed subject
    or reference are a 400 on the field that named them (``reference.checkpoint``...)."""
    if len(subject.given()) != 1 or subject.endpoint not in (None, ""):
        raise ValidationFailed("give exactly one of model (a model id) or checkpoint (an id)", field="model")
    checkpoint, base_model = _model_choice_resolve(team, subject, prefix="")
    return {
        "checkpoint": checkpoint,
        "base_model": base_model,
        "task_set": scoped_reference(TaskSet, team, task_set, field="task_set"),
        "environment": scoped_reference(Environment, team, environment, field="environment"),
        "reward": scoped_reference(RewardDefinition, team, reward, field="reward"),
        **_reference_resolve(team, reference),
    }


def evaluation_reference(evaluation: Evaluation) -> dict[str, Any] | None:
    """The reference as the API shows it: ``{"checkpoint", "model"}`` for a checkpoint or base
    model (its model id), ``{"endpoint", "model"}`` for a model behind a team endpoint, else None."""
    if evaluation.reference_checkpoint_id or evaluation.reference_base_model_id:
        return {
            "checkpoint": evaluation.reference_checkpoint_id,
            "model": model_label(evaluation.reference_checkpoint, evaluation.reference_base_model),
        }
    if evaluation.reference_endpoint_id or evaluation.reference_model:
        return {"endpoint": evaluation.reference_endpoint_id, "model": evaluation.reference_model}
    return None


def evaluation_reference_label(evaluation: Evaluation) -> str:
    """The reference in words (the dashboard): its model id, or ``<model> on <endpoint>``."""
    reference = evaluation_reference(evaluation)
    if reference is None:
        return ""
    if "checkpoint" in reference:
        return reference["model"]
    endpoint = evaluation.reference_endpoint.name if evaluation.reference_endpoint else "a deleted endpoint"
    return f"{reference['model']} on {endpoint}"


def checkpoint_card(*, checkpoint: Checkpoint, kind: str) -> str:
    """The model card of ``checkpoint`` (its adapter archive and a merged export alike): the
    model, base model, LoRA, the run's config, the step's metrics and its succeeded evaluations."""
    model = checkpoint.model
    evaluations = [
        {"id": e.pk, "split": e.split, "results": e.results}
        for e in checkpoint_evaluations(checkpoint=checkpoint).filter(status="succeeded")
    ]
    return model_card(
        title=f"{model.project.name}/{model.name}:{checkpoint.step}",
        base_model=model.base_model.name,
        step=checkpoint.step,
        kind=kind,
        lora=model.lora,
        run_config=checkpoint.run.config if checkpoint.run is not None else None,
        metrics=checkpoint.metrics or {},
        evaluations=evaluations,
    )


def run_evaluation_inputs(*, run: Run) -> dict[str, Any]:
    """What an evaluation of a run (a fine-tuning job among them) reads unless the request says
    otherwise: its newest trained checkpoint (None before its first step), its rows, its environment
    and its reward definition (a job's grader), on the held-out rows when the task set has some
    (a job with a validation file), else on every row. A golden comparison is this with a
    ``reference``: the model the job replaces, graded by the same grader on the same rows."""
    latest = job_latest_checkpoint(run=run)
    return {
        "checkpoint": latest.pk if latest is not None else None,
        "task_set": run.task_set_id,
        "environment": run.environment_id,
        "reward": run.reward_id,
        "split": "validation" if run.task_set is not None and run.task_set.validation_count else "all",
    }
