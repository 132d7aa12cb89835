"""Evaluation services: the evaluation state machine, and the one resolution of a request's subject
and reference that the API and the dashboard share."""

from __future__ import annotations

import itertools

import pytest

from projects import selectors, services
from projects.errors import InvalidTransition, ValidationFailed
from projects.models import Evaluation, EvaluationEvent, EvaluationStatus

pytestmark = pytest.mark.django_db


def make_evaluation(setup) -> Evaluation:
    return services.evaluation_create(
        task_set=setup.task_set, environment=setup.environment, reward=setup.reward, base_model=setup.base
    )


QUEUED, RUNNING = EvaluationStatus.QUEUED, EvaluationStatus.RUNNING
SUCCEEDED, FAILED, CANCELLED = EvaluationStatus.SUCCEEDED, EvaluationStatus.FAILED, EvaluationStatus.CANCELLED
# Every allowed move, written out by hand; ``running → running`` is an orphan taken over.
ALLOWED = {
    (QUEUED, RUNNING), (QUEUED, FAILED), (QUEUED, CANCELLED),
    (RUNNING, RUNNING), (RUNNING, SUCCEEDED), (RUNNING, FAILED), (RUNNING, CANCELLED),
}  # fmt: skip


@pytest.mark.parametrize(("start", "target"), list(itertools.product(EvaluationStatus.values, repeat=2)))
def test_every_evaluation_transition_follows_the_table_and_records_one_event(alpha_setup, start, target):
    evaluation = make_evaluation(alpha_setup)
    Evaluation.objects.filter(pk=evaluation.pk).update(status=start)
    events = EvaluationEvent.objects.filter(evaluation=evaluation)
    events_before = events.count()
    try:
        services.evaluation_transition(evaluation_id=evaluation.pk, to=target, message="go")
        moved = True
    except InvalidTransition:
        moved = False
    evaluation.refresh_from_db()
    assert moved == ((start, target) in ALLOWED), "an illegal transition is refused, a legal one made"
    assert evaluation.status == (target if moved else start)
    assert events.count() == events_before + moved
    assert (evaluation.finished_at is not None) == (moved and target in services.EVALUATION_TERMINAL_STATUSES)


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
