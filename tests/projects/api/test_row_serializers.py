"""The row serializers (``projects.api.serializers.RowOut``: runs, run events, step metrics,
trajectories, checkpoints) render exactly what DRF's ModelSerializer renders for the same fields:
keys in the same order, values of the same types, datetimes in the same ISO 8601 text, nulls as
None. Rows are read back from the database, as a list endpoint reads them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework import serializers

from projects.api import serializers as s
from projects.models import Checkpoint, Run, RunEvent, StepMetrics, Trajectory
from tests import factories

pytestmark = pytest.mark.django_db

WHEN = datetime(2026, 3, 29, 0, 59, 58, 123456, tzinfo=UTC)  # 01:59 the night Paris goes to summer time


def _typed(row: dict[str, Any]) -> list[tuple[str, str, Any]]:
    return [(key, type(value).__name__, value) for key, value in row.items()]


def _assert_renders_like_drf(serializer_class: type[serializers.ModelSerializer], rows: list[Any]) -> None:
    assert issubclass(serializer_class, s.RowOut)
    fast = serializer_class(rows, many=True).data
    drf_serializer = serializer_class()
    drf = [serializers.ModelSerializer.to_representation(drf_serializer, row) for row in rows]
    assert [_typed(row) for row in fast] == [_typed(row) for row in drf]
    single = serializer_class(rows[0]).data
    assert _typed(single) == _typed(drf[0])


@pytest.fixture
def runs(alpha_setup) -> list[Run]:
    """A run with every field set (a fork of a checkpoint, started, failed, with a heartbeat) and
    a client run with every nullable field null; both read back from the database."""
    model = alpha_setup.model
    full = factories.RunFactory(
        model=model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    checkpoint = factories.CheckpointFactory(model=model, run=full, step=3)
    Run.objects.filter(pk=full.pk).update(
        config={"steps": 4, "learning_rate": 1e-5, "nested": {"list": [1, 2.5, None, "x"]}},
        status="failed", error="CUDA out of memory", cancel_requested=True, pause_requested=True,
        start_step=1, current_step=3, total_steps=4, attempts=2, forked_from=checkpoint,
        heartbeat_at=WHEN, started_at=WHEN - timedelta(hours=1), finished_at=WHEN + timedelta(microseconds=1),
    )  # fmt: skip
    bare = factories.RunFactory(
        model=model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    Run.objects.filter(pk=bare.pk).update(
        kind="client", task_set=None, environment=None, reward=None, config={}, forked_from=None,
        heartbeat_at=None, started_at=None, finished_at=None,
    )  # fmt: skip
    return list(Run.objects.filter(pk__in=[full.pk, bare.pk]).order_by("-id"))


def test_runs_render_like_drf(runs):
    _assert_renders_like_drf(s.RunOut, runs)
    row = s.RunOut(runs[-1]).data  # the full run: the fields above made it through
    assert (row["object"], row["steps_done"], row["heartbeat_at"]) == (
        "run",
        2,
        "2026-03-29T00:59:58.123456Z",
    )
    assert s.RunOut(runs[0]).data["task_set"] is None


@pytest.mark.parametrize("zone", ["Europe/Paris", "Asia/Kolkata", "America/St_Johns"])
def test_runs_render_like_drf_in_another_time_zone(runs, zone):
    with timezone.override(zone):
        _assert_renders_like_drf(s.RunOut, runs)
        assert not s.RunOut(runs[-1]).data["heartbeat_at"].endswith("Z")


def test_step_metrics_trajectories_events_and_checkpoints_render_like_drf(runs):
    run = runs[-1]
    StepMetrics.objects.create(
        run=run, step=1, reward_mean=0.25, reward_std=0.0, loss=-1.5, metrics={"kl": 1e-3}
    )
    StepMetrics.objects.create(run=run, step=2, reward_mean=None, reward_std=None, loss=None, metrics={})
    _assert_renders_like_drf(s.StepMetricsOut, list(StepMetrics.objects.filter(run=run)))

    Trajectory.objects.create(
        run=run, step=1, group_index=0, sample_index=1, task_row_index=7, reward=1.0,
        messages=[{"role": "user", "content": "é \u2028 \U0001f600"}], sub_rewards={"exact": 1},
        errors=["timeout"], metrics={"turns": 2}, prompt_tokens=40, completion_tokens=3, finish_reason="stop",
    )  # fmt: skip
    Trajectory.objects.create(
        run=run, step=1, group_index=0, sample_index=2, task_row_index=None, messages=[], reward=0.0
    )
    _assert_renders_like_drf(s.TrajectoryOut, list(Trajectory.objects.filter(run=run).order_by("id")))

    RunEvent.objects.create(run=run, level="warn", type="metrics", message="step 1", data={"step": 1})
    _assert_renders_like_drf(s.RunEventOut, list(RunEvent.objects.filter(run=run).order_by("id")))

    factories.CheckpointFactory(model=run.model, run=None, step=9)
    checkpoints = list(
        Checkpoint.objects.filter(model=run.model).select_related("model__project").order_by("step")
    )
    assert {checkpoint.run_id for checkpoint in checkpoints} == {run.pk, None}
    _assert_renders_like_drf(s.CheckpointOut, checkpoints)
