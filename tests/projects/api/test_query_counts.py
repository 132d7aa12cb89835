"""No N+1: the read endpoints the API benchmark measures (benchmarks/api_pg.py) make the same
number of SQL queries at 2 rows as at 12, with the rows spread over different models and projects
so a lazy foreign-key read per row would show."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from django.db import connection, reset_queries
from django.test.utils import CaptureQueriesContext

from projects import services
from projects.gateway import views as gateway_views
from projects.models import Checkpoint, Run, StepMetrics, Trajectory
from tests import factories

pytestmark = pytest.mark.django_db

SMALL, LARGE = 2, 12


def _count(call: Callable[[], int]) -> tuple[int, int]:
    """(queries made, items returned) by ``call``, after a first call that warms what is done once
    (an API key's ``last_used_at`` is written at most once a minute)."""
    call()
    reset_queries()  # a request resets the log when it starts: begin from an empty one
    with CaptureQueriesContext(connection) as queries:
        items = call()
    return len(queries.captured_queries), items


def _get(client, url: str) -> Callable[[], int]:
    def call() -> int:
        response = client.get(url)
        assert response.status_code == 200, response.content[:300]
        return len(response.json()["data"])

    return call


def _models(setup, count: int) -> list:
    """``count`` trainable models, each in a project of its own."""
    return [
        factories.TrainableModelFactory(
            project=factories.ProjectFactory(team=setup.project.team), base_model=setup.base
        )
        for _ in range(count)
    ]


def _runs(setup, count: int) -> list[Run]:
    """``count`` finished runs, each of another model and project (bulk rows, no enqueue)."""
    template = services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward
    )
    Run.objects.filter(pk=template.pk).update(status="succeeded")
    fields = {
        f.attname: getattr(template, f.attname)
        for f in Run._meta.concrete_fields
        if not f.primary_key and f.attname not in {"model_id", "project_id"}
    }
    rows = [Run(**{**fields, "model_id": model.pk, "project_id": model.project_id, "status": "succeeded"})
            for model in _models(setup, count - 1)]  # fmt: skip
    Run.objects.bulk_create(rows)
    return [template, *rows]


def _assert_constant(measure: Callable[[int], Callable[[], int]]) -> None:
    small = _count(measure(SMALL))
    large = _count(measure(LARGE))
    assert (small[1], large[1]) == (SMALL, LARGE), "the endpoint must list what the test made"
    assert small[0] == large[0], f"{small[0]} queries for {SMALL} rows, {large[0]} for {LARGE}"


def test_runs_list_queries_do_not_grow_with_runs(alpha_setup, key_client, cast):
    def measure(size: int) -> Callable[[], int]:
        Run.objects.filter(project__team=cast.alpha).delete()
        _runs(alpha_setup, size)
        return _get(key_client, "/api/v1/runs/")

    _assert_constant(measure)


def test_run_metrics_queries_do_not_grow_with_steps(alpha_setup, key_client):
    (run,) = _runs(alpha_setup, 1)

    def measure(size: int) -> Callable[[], int]:
        StepMetrics.objects.filter(run=run).delete()
        StepMetrics.objects.bulk_create(
            StepMetrics(run=run, step=step, reward_mean=0.5, metrics={"kl": 0.0})
            for step in range(1, size + 1)
        )
        return _get(key_client, f"/api/v1/runs/{run.pk}/metrics/")

    _assert_constant(measure)


def test_step_trajectories_queries_do_not_grow_with_trajectories(alpha_setup, key_client):
    (run,) = _runs(alpha_setup, 1)

    def measure(size: int) -> Callable[[], int]:
        Trajectory.objects.filter(run=run).delete()
        Trajectory.objects.bulk_create(
            Trajectory(
                run=run,
                step=1,
                group_index=index // 4,
                sample_index=index % 4,
                task_row_index=0,
                messages=[{"role": "assistant", "content": "hi"}],
                reward=1.0,
            )  # fmt: skip
            for index in range(size)
        )
        Trajectory.objects.create(run=run, step=2, group_index=0, sample_index=0, messages=[], reward=0.0)
        return _get(key_client, f"/api/v1/runs/{run.pk}/trajectories/?step=1")

    _assert_constant(measure)


def test_model_checkpoint_list_queries_do_not_grow_with_checkpoints(alpha_setup, key_client):
    (run,) = _runs(alpha_setup, 1)

    def measure(size: int) -> Callable[[], int]:
        Checkpoint.objects.filter(model=alpha_setup.model).delete()
        for step in range(size):
            services.checkpoint_record(model=alpha_setup.model, run=run, step=step, path=f"/nowhere/{step}")
        return _get(key_client, f"/api/v1/models/{alpha_setup.model.pk}/checkpoints/")

    _assert_constant(measure)


def test_run_checkpoint_list_queries_do_not_grow_with_checkpoints(alpha_setup, key_client):
    (run,) = _runs(alpha_setup, 1)

    def measure(size: int) -> Callable[[], int]:
        Checkpoint.objects.filter(model=alpha_setup.model).delete()
        for step in range(size):
            services.checkpoint_record(model=alpha_setup.model, run=run, step=step, path=f"/nowhere/{step}")
        return _get(key_client, f"/api/v1/runs/{run.pk}/checkpoints/")

    _assert_constant(measure)


def test_gateway_model_list_queries_do_not_grow_with_checkpoints(alpha_setup, alpha_key, cast):
    """``/v1/models`` runs ``_list_models`` (authentication and the listing) on the gateway's own
    database threads; its queries are counted by calling that body here."""
    services.client_model_register(
        team=cast.alpha, entity=None, project="art", name="agent", base_model="tiny"
    )

    def measure(size: int) -> Callable[[], int]:
        Checkpoint.objects.filter(model__project__team=cast.alpha).exclude(
            model__project__name="art"
        ).delete()
        for step, model in enumerate(_models(alpha_setup, size)):
            services.checkpoint_record(model=model, run=None, step=step, path=f"/nowhere/{step}")

        def call() -> int:
            body = gateway_views._list_models(f"Bearer {alpha_key}")
            # The checkpoints made here (not their :latest aliases, nor the ART client model's).
            return len(
                [item for item in body["data"] if re.fullmatch(r"project\d+/model\d+:\d+", item["id"])]
            )

        return call

    _assert_constant(measure)
