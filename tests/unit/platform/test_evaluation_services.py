"""Evaluation services: the evaluation state machine, and the one resolution of a request's subject
and reference that the API and the dashboard share."""

from __future__ import annotations

import pytest

from projects import selectors, services
from projects.errors import InvalidTransition, ValidationFailed
from projects.models import Evaluation, EvaluationEvent, EvaluationStatus

pytestmark = pytest.mark.django_db


def make_evaluation(setup) -> Evaluation:
    return services.evaluation_create(
        task_set=setup.task_set, environment=setup.environment, reward=setup.reward, base_model=setup.base
    )


@pytest.mark.parametrize(
    ("start", "target", "allowed"),
    [
        (EvaluationStatus.QUEUED, EvaluationStatus.RUNNING, True),
        (EvaluationStatus.QUEUED, EvaluationStatus.CANCELLED, True),
        (EvaluationStatus.QUEUED, EvaluationStatus.SUCCEEDED, False),
        (EvaluationStatus.RUNNING, EvaluationStatus.RUNNING, True),  # an orphan taken over
        (EvaluationStatus.RUNNING, EvaluationStatus.SUCCEEDED, True),
        (EvaluationStatus.RUNNING, EvaluationStatus.QUEUED, False),
        (EvaluationStatus.SUCCEEDED, EvaluationStatus.RUNNING, False),
        (EvaluationStatus.FAILED, EvaluationStatus.CANCELLED, False),
        (EvaluationStatus.CANCELLED, EvaluationStatus.FAILED, False),
    ],
)
def test_evaluation_transition_table_is_enforced_and_recorded(alpha_setup, start, target, allowed):
    evaluation = make_evaluation(alpha_setup)
    Evaluation.objects.filter(pk=evaluation.pk).update(status=start)
    events_before = EvaluationEvent.objects.filter(evaluation=evaluation).count()
    if allowed:
        moved = services.evaluation_transition(evaluation_id=evaluation.pk, to=target, message="go")
        assert moved.status == target
        assert (moved.finished_at is not None) == (target in services.EVALUATION_TERMINAL_STATUSES)
        assert EvaluationEvent.objects.filter(evaluation=evaluation).count() == events_before + 1
    else:
        with pytest.raises(InvalidTransition):
            services.evaluation_transition(evaluation_id=evaluation.pk, to=target, message="go")
        evaluation.refresh_from_db()
        assert evaluation.status == start
        assert EvaluationEvent.objects.filter(evaluation=evaluation).count() == events_before


def test_a_finished_evaluation_cannot_be_cancelled_or_failed(alpha_setup):
    evaluation = make_evaluation(alpha_setup)
    assert services.evaluation_claim(evaluation_id=evaluation.pk, worker="w1") is not None
    assert services.evaluation_finish(evaluation_id=evaluation.pk, worker="w1", results={"n": 0}, samples=[])
    with pytest.raises(InvalidTransition, match="the evaluation already succeeded"):
        services.evaluation_cancel(evaluation=evaluation)
    assert services.evaluation_fail(evaluation_id=evaluation.pk, error="late") is False
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.SUCCEEDED and evaluation.error == ""


def test_inputs_resolve_names_the_field_of_another_teams_row(alpha_setup, cast):
    setup = alpha_setup
    inputs = selectors.evaluation_inputs_resolve(
        team=cast.alpha,
        subject=selectors.ModelChoice(base_model=setup.base.pk),
        task_set=setup.task_set.pk,
        environment=setup.environment.pk,
        reward=setup.reward.pk,
        reference=selectors.ModelChoice(model_id="tiny"),
    )
    assert inputs["base_model"] == setup.base and inputs["checkpoint"] is None
    assert inputs["reference_base_model"] == setup.base and inputs["task_set"] == setup.task_set
    for field, kwargs in (
        ("task_set", {"task_set": setup.task_set.pk}),
        ("model", {"subject": selectors.ModelChoice()}),
    ):
        with pytest.raises(ValidationFailed) as caught:
            selectors.evaluation_inputs_resolve(
                team=cast.beta,
                **{
                    "subject": selectors.ModelChoice(base_model=setup.base.pk),
                    "task_set": setup.task_set.pk,
                    "environment": setup.environment.pk,
                    "reward": setup.reward.pk,
                    **kwargs,
                },
            )
        assert caught.value.field == field
