"""A queued evaluation (POST /api/v1/evaluations) as claimed work: a checkpoint or base model (and
optionally a reference) evaluated on a task set's rows; results, samples and events go through
``projects.services``. A taken-over evaluation restarts from scratch: no partial results.
A reference endpoint's key is decrypted here, in the worker, and never logged.
"""

from __future__ import annotations

import gc
from typing import Any

from django.conf import settings

from projects import secrets, selectors, services
from projects.grader_secrets import grader_for_build
from projects.jobs.claimed import Claimed, Job, readable
from projects.models import BaseModel, Checkpoint, Evaluation
from projects.outbound import outbound_policy
from training.engines.base import SamplingParams
from training.rollouts.remote import ChatEndpoint, RemotePolicy
from training.runs.evaluation import REFERENCE, LocalPolicy, load_local_policy, with_reference
from training.runs.evaluation import evaluate as evaluate_policy


def _evaluate(claimed: Claimed[Evaluation]) -> str:
    evaluation, worker, heartbeat = claimed.row, claimed.worker, claimed.heartbeat

    def note(message: str, **data: Any) -> None:
        services.evaluation_event_add(evaluation=evaluation, message=message, data=data)

    def active() -> bool:
        return not heartbeat.lost and selectors.evaluation_is_active(
            evaluation_id=evaluation.pk, worker=worker
        )

    rows = selectors.evaluation_rows(evaluation=evaluation)
    if not rows:
        raise ValueError(f"the task set has no {evaluation.split} rows (any more)")
    config = evaluation.config
    sampling = SamplingParams(
        temperature=float(config.get("temperature", 0.0)),
        max_new_tokens=int(config.get("max_new_tokens", 32)),
        stop=list(config.get("stop", [])),
        seed=int(config.get("seed", 0)),
    )
    team = evaluation.project.team
    grading = {
        "judge": services.judge_client(team=team),
        "sandbox": services.sandbox_config(team_id=team.pk),
        "outbound": outbound_policy(),  # an endpoint grader's host, as a run's
    }
    environment = services.environment_build(environment=evaluation.environment)
    common: dict[str, Any] = {
        "samples_per_row": evaluation.samples_per_row,
        "pass_threshold": evaluation.pass_threshold,
        **grading,
    }
    try:
        subject_label = selectors.model_label(evaluation.checkpoint, evaluation.base_model)
        if evaluation.checkpoint is None and evaluation.base_model is None:
            raise ValueError("the evaluated checkpoint was deleted")
        policy: Any = _local_policy(evaluation.checkpoint, evaluation.base_model, sampling, subject_label)
        note(f"Loaded {subject_label}; evaluating {len(rows)} rows x {evaluation.samples_per_row} samples")
        grader_spec = grader_for_build(evaluation.reward.spec)  # endpoint headers decrypted (grader_secrets)
        result = evaluate_policy(policy, rows, environment, grader_spec, **common)
        del policy
        gc.collect()
        note(
            f"{subject_label}: {selectors.evaluation_results_summary(result.results)}",
            **_flat(result.results),
        )
        if not active():
            return "cancelled"
        reference = _reference_policy(evaluation, sampling)
        if reference is not None:
            note(f"Evaluating the reference {reference.name}")
            reference_result = evaluate_policy(
                reference, rows, environment, grader_spec, side=REFERENCE, **common
            )
            note(
                f"Reference {reference.name}: {selectors.evaluation_results_summary(reference_result.results)}"
            )
            result = with_reference(result, reference_result)
    finally:
        close = getattr(environment, "close", None)
        if close is not None:
            close()
    if not services.evaluation_finish(
        evaluation_id=evaluation.pk, worker=worker, results=result.results, samples=result.samples
    ):
        return "cancelled"
    return "succeeded"


def _flat(results: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in results.items() if not isinstance(value, dict)}


def _local_policy(
    checkpoint: Checkpoint | None, base_model: BaseModel | None, sampling: SamplingParams, name: str
) -> LocalPolicy:
    if checkpoint is not None:
        source = checkpoint.model.base_model.source
    else:
        assert base_model is not None  # the caller checked that one of the two is set
        source = base_model.source
    return load_local_policy(
        base_model_source=source,
        model_cache_dir=settings.MODEL_CACHE_DIR,
        adapter_path=(checkpoint.path or None) if checkpoint is not None else None,  # "": base
        sampling=sampling,
        name=name,
        device=settings.TRAINING_DEVICE,
    )


def _reference_policy(evaluation: Evaluation, sampling: SamplingParams) -> LocalPolicy | RemotePolicy | None:
    """The reference side: our checkpoint or base model on this worker, or a model behind a team
    endpoint (its key decrypted here, in the worker, and never logged)."""
    if evaluation.reference_checkpoint is not None or evaluation.reference_base_model is not None:
        label = selectors.model_label(evaluation.reference_checkpoint, evaluation.reference_base_model)
        return _local_policy(
            evaluation.reference_checkpoint, evaluation.reference_base_model, sampling, label
        )
    endpoint = evaluation.reference_endpoint
    if endpoint is None:
        if evaluation.reference_model:
            raise ValueError("the reference endpoint was deleted")
        return None
    return RemotePolicy(
        endpoint=ChatEndpoint(
            base_url=endpoint.base_url,
            api_key=secrets.decrypt(endpoint.api_key_encrypted),
            timeout=endpoint.timeout_s,
            outbound=outbound_policy(),
        ),
        model=evaluation.reference_model,
        temperature=sampling.temperature,
        max_tokens=sampling.max_new_tokens,
        seed=sampling.seed,
        name=f"{endpoint.name}:{evaluation.reference_model}",
    )


def _claim(evaluation_id: int, worker: str) -> Evaluation | None:
    return services.evaluation_claim(evaluation_id=evaluation_id, worker=worker)


def _beat(evaluation_id: int, worker: str) -> bool:
    return services.evaluation_heartbeat(evaluation_id=evaluation_id, worker=worker)


def _fail(evaluation_id: int, worker: str, exc: BaseException) -> None:
    services.evaluation_fail(evaluation_id=evaluation_id, error=readable(exc), worker=worker)


EVALUATION: Job[Evaluation] = Job(kind="evaluation", claim=_claim, beat=_beat, work=_evaluate, fail=_fail)
