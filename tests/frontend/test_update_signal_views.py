"""The trajectory viewer and the API show the advantage the trainer used: the value stored with the
step, or for rows recorded before it was stored the trainer's computation again, length penalty
included (the demo's 1/16 of a reward per token), never the grader's rewards alone."""

from __future__ import annotations

import pytest
from django.test import Client

from projects import services
from projects.models import Trajectory

pytestmark = pytest.mark.django_db

# The demo's penalty over the whole reply budget: every token costs 1/16 of a reward.
DEMO_PENALTY = {"max_new_tokens": 16, "length_penalty_buffer": 16}
# A right answer in 12 tokens (1.0 - 12/16) and a half-right one in 4 (0.5 - 4/16) both train as
# 0.25: a zero-variance group the trainer skips, where the rewards alone give advantages of ±1.
FLAT_AFTER_PENALTY = [(1.0, 12), (0.5, 4), (1.0, 12), (0.5, 4)]


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def make_run(setup, user, **config):
    return services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward,
        config={"steps": 3, **config}, created_by=user,
    )  # fmt: skip


def record(run, step, group, sample, reward, tokens, metrics=None):
    return Trajectory.objects.create(
        run=run, step=step, group_index=group, sample_index=sample, task_row_index=0,
        messages=[{"role": "assistant", "content": f"answer {sample}"}], reward=reward,
        completion_tokens=tokens, finish_reason="stop", metrics=metrics or {},
    )  # fmt: skip


def viewer(user, run, query):
    client = Client()
    client.force_login(user)
    return client.get(f"/runs/{run.pk}/trajectories?{query}")


def api_advantages(key_client, run, step):
    data = key_client.get(f"/api/v1/runs/{run.pk}/trajectories/?step={step}").json()["data"]
    return [
        (row["metrics"]["advantage"], row["metrics"]["length_penalty"], row["metrics"]["trained"])
        for row in data
    ]


def test_rows_recorded_without_their_advantage_get_the_trainers_with_the_length_penalty(
    cast, alpha_setup, key_client
):
    run = make_run(alpha_setup, cast.alice, **DEMO_PENALTY)
    for sample, (reward, tokens) in enumerate(FLAT_AFTER_PENALTY):
        record(run, 1, 0, sample, reward, tokens)
    for sample, (reward, tokens) in enumerate([(1.0, 1), (0.0, 2)]):  # differs after the penalty too
        record(run, 1, 1, sample, reward, tokens)
    response = viewer(cast.alice, run, "step=1&group=0")
    summary = response.context["summary"]
    assert summary.zero_variance and summary.mean == 0.25 and summary.std == 0.0
    assert [c.advantage for c in response.context["columns"]] == [0.0] * 4
    html = response.content.decode()
    assert "advantage +1" not in html and "zero variance" in html and "length penalty -0.75" in html
    assert "not trained" in html and "(reward + length penalty)" in html
    assert response.context["groups"] == [(0, True), (1, False)]
    assert viewer(cast.alice, run, "step=1&variance=1").context["groups"] == [(1, False)]
    assert api_advantages(key_client, run, 1)[:4] == [
        (0.0, -0.75, False), (0.0, -0.25, False), (0.0, -0.75, False), (0.0, -0.25, False)
    ]  # fmt: skip
    # Group 1: 1.0 - 1/16 against 0.0 - 2/16: ±1 up to the std's epsilon, both trained.
    assert [(round(a, 4), p, t) for a, p, t in api_advantages(key_client, run, 1)[4:]] == [
        (1.0, -0.0625, True), (-1.0, -0.125, True)
    ]  # fmt: skip


def test_the_viewer_and_the_api_show_the_advantage_stored_with_the_step(cast, alpha_setup, key_client):
    run = make_run(alpha_setup, cast.alice, **DEMO_PENALTY)
    # Values as a step stores them (training.runs.steps.record_update_signal); 0.5 is no recomputation
    # of these rewards, so only a read of the stored value shows it.
    stored = [(0.5, -0.0625, True), (-0.5, -0.125, True), (0.0, -0.0625, False)]
    for sample, ((reward, tokens), (advantage, penalty, trained)) in enumerate(
        zip([(1.0, 1), (0.0, 2), (1.0, 1)], stored, strict=True)
    ):
        metrics = {"length_penalty": penalty, "advantage": advantage, "trained": trained, "policy_step": 0}
        record(run, 1, 0, sample, reward, tokens, metrics)
    columns = viewer(cast.alice, run, "step=1&group=0").context["columns"]
    assert sorted(c.advantage for c in columns) == [-0.5, 0.0, 0.5]
    assert [c.signal.stored for c in columns] == [True] * 3
    assert api_advantages(key_client, run, 1) == stored
