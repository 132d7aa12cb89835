"""/api/v1/costs and /api/v1/runs/{id}/cost: usage summed over step metrics, priced by settings,
team-scoped; plus the pricing arithmetic (projects.selectors.costs.priced) on plain values."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from projects import services
from projects.models import Evaluation, StepMetrics
from projects.selectors.costs import Prices, priced
from tests import factories

USAGE = {"steps": 1, "gpu_seconds": 7200.0, "cpu_seconds": 1800.0, "sampled_tokens": 1500,
         "trained_tokens": 500, "judge_prompt_tokens": 3000, "judge_completion_tokens": 1000}  # fmt: skip


def test_nothing_priced_is_null_not_zero():
    assert priced(USAGE, Prices()) is None


def test_every_part_priced():
    cost = priced(USAGE, Prices(gpu_hour=2.5, cpu_hour=0.1, per_1k_tokens=0.01, per_1k_judge_tokens=0.5,
                                currency="EUR"))  # fmt: skip
    # 2 GPU-hours × 2.5, 0.5 CPU-hours × 0.1, 2k tokens × 0.01, 4k judge tokens × 0.5
    assert cost == {"currency": "EUR", "gpu": 5.0, "cpu": 0.05, "tokens": 0.02, "judge_tokens": 2.0,
                    "total": 7.07, "not_priced": []}  # fmt: skip


def test_a_used_part_without_a_price_is_named_and_left_out_of_the_total():
    cost = priced(USAGE, Prices(gpu_hour=3.0))
    assert cost is not None
    assert (cost["gpu"], cost["cpu"], cost["tokens"], cost["judge_tokens"]) == (6.0, None, None, None)
    assert cost["total"] == 6.0 and cost["not_priced"] == ["cpu", "tokens", "judge_tokens"]
    unused = priced({**USAGE, "cpu_seconds": 0.0, "judge_prompt_tokens": 0, "judge_completion_tokens": 0},
                    Prices(gpu_hour=3.0))  # fmt: skip
    assert unused is not None and unused["cpu"] == 0.0 and unused["not_priced"] == ["tokens"]


def _step(run, step, *, seconds, kind="cpu", sampled=100, trained=80, judge=(10, 2), day=None):
    row = StepMetrics.objects.create(
        run=run, step=step, reward_mean=0.5,
        metrics={"device_kind": kind, "device_count": 1.0, "device_seconds": seconds, "step_seconds": seconds,
                 "completion_tokens": float(sampled), "trainable_tokens": float(trained),
                 "judge_prompt_tokens": float(judge[0]), "judge_completion_tokens": float(judge[1])},
    )  # fmt: skip
    if day is not None:
        StepMetrics.objects.filter(pk=row.pk).update(created_at=datetime(*day, 12, tzinfo=UTC))
    return row


@pytest.fixture
def runs(alpha_setup):
    first = factories.RunFactory(model=alpha_setup.model, task_set=alpha_setup.task_set,
                                 environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    other_model = factories.TrainableModelFactory(project=alpha_setup.project, name="second",
                                                  base_model=alpha_setup.base)  # fmt: skip
    second = factories.RunFactory(model=other_model, task_set=alpha_setup.task_set,
                                  environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    _step(first, 1, seconds=1800.0, sampled=100, trained=80, judge=(10, 2), day=(2026, 3, 1))
    _step(first, 2, seconds=3600.0, sampled=60, trained=40, judge=(5, 1), day=(2026, 3, 2))
    _step(second, 1, seconds=360.0, kind="gpu", sampled=7, trained=3, judge=(0, 0), day=(2026, 3, 2))
    StepMetrics.objects.create(run=second, step=2, metrics={"loss": 1.0})  # recorded before costs existed
    return type("Runs", (), {"first": first, "second": second})


def test_run_cost_is_the_sum_of_its_steps(runs, key_client, settings):
    settings.PRICE_PER_CPU_HOUR = 0.2
    body = key_client.get(f"/api/v1/runs/{runs.first.pk}/cost").json()
    assert body["object"] == "run.cost" and body["run"] == runs.first.pk and body["steps"] == 2
    assert (body["cpu_seconds"], body["gpu_seconds"], body["cpu_hours"]) == (5400.0, 0.0, 1.5)
    assert (body["sampled_tokens"], body["trained_tokens"], body["total_tokens"]) == (160, 120, 280)
    assert (body["judge_prompt_tokens"], body["judge_completion_tokens"], body["judge_tokens"]) == (15, 3, 18)
    assert body["cost"]["cpu"] == pytest.approx(0.3) and body["cost"]["currency"] == "USD"
    assert body["cost"]["not_priced"] == ["tokens", "judge_tokens"]


def test_unpriced_costs_are_null(runs, key_client):
    assert key_client.get(f"/api/v1/runs/{runs.first.pk}/cost").json()["cost"] is None


def test_costs_per_day_model_and_run(runs, key_client, settings):
    settings.PRICE_PER_GPU_HOUR = 10.0
    settings.PRICE_PER_CPU_HOUR = 1.0
    by_day = key_client.get("/api/v1/costs", {"group_by": "day"}).json()
    assert by_day["group_by"] == ["day"]
    # The step without usage metrics counts as a step of its day, with nothing used.
    days = [(row["day"], row["steps"], row["cpu_seconds"], row["gpu_seconds"]) for row in by_day["data"]]
    today = StepMetrics.objects.get(run=runs.second, step=2).created_at.date().isoformat()
    assert days[:2] == [("2026-03-01", 1, 1800.0, 0.0), ("2026-03-02", 2, 3600.0, 360.0)]
    assert days[2:] == [(today, 1, 0.0, 0.0)]
    assert by_day["data"][1]["cost"]["total"] == pytest.approx(1.0 + 1.0)  # 1 CPU-hour + 0.1 GPU-hour × 10
    assert by_day["totals"]["steps"] == 4 and by_day["totals"]["cost"]["total"] == pytest.approx(2.5)

    by_model = key_client.get("/api/v1/costs", {"group_by": "model"}).json()["data"]
    assert [(row["model"], row["sampled_tokens"]) for row in by_model] == [
        ("math/agent", 160),
        ("math/second", 7),
    ]
    by_run = key_client.get("/api/v1/costs", {"group_by": "run", "start": "2026-03-02", "end": "2026-03-02"})
    assert [(row["run"], row["steps"]) for row in by_run.json()["data"]] == [
        (runs.first.pk, 1),
        (runs.second.pk, 1),
    ]
    one_run = key_client.get("/api/v1/costs", {"group_by": "day", "run": runs.second.pk}).json()
    assert one_run["totals"]["gpu_seconds"] == 360.0 and one_run["totals"]["cpu_seconds"] == 0.0


def test_viewer_reads_and_outsider_sees_nothing(runs, bob_client, charlie_client):
    assert bob_client.get(f"/api/v1/runs/{runs.first.pk}/cost").status_code == 200
    assert bob_client.get("/api/v1/costs").json()["totals"]["steps"] == 4
    assert charlie_client.get(f"/api/v1/runs/{runs.first.pk}/cost").status_code == 404
    outsider = charlie_client.get("/api/v1/costs").json()
    assert (
        outsider["data"] == [] and outsider["totals"]["steps"] == 0 and outsider["totals"]["cpu_seconds"] == 0
    )
    refused = charlie_client.get("/api/v1/costs", {"run": runs.first.pk})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "run"


@pytest.mark.parametrize(
    ("params", "field"),
    [({"group_by": "colour"}, "group_by"), ({"start": "yesterday"}, "start"), ({"run": "x"}, "run"),
     ({"start": "2026-03-02", "end": "2026-03-01"}, "end")],
)  # fmt: skip
def test_bad_parameters_are_400_on_their_field(runs, key_client, params, field):
    response = key_client.get("/api/v1/costs", params)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_query_count_does_not_grow_with_steps(runs, key_client):
    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert key_client.get("/api/v1/costs", {"group_by": "day,model"}).status_code == 200
            assert key_client.get(f"/api/v1/runs/{runs.first.pk}/cost").status_code == 200
        return len(queries)

    count()  # warm (an API key's last-used time is written at most once a minute)
    before = count()
    for step in range(3, 13):
        _step(runs.first, step, seconds=1.0)
    assert count() == before


def _used(seconds: float, kind: str, sampled: int, judge: tuple[int, int]) -> dict:
    return {"device_kind": kind, "device_count": 1.0, "device_seconds": seconds, "completion_tokens": sampled,
            "judge_prompt_tokens": judge[0], "judge_completion_tokens": judge[1]}  # fmt: skip


def test_evaluations_count_in_run_and_standalone_with_a_local_reference(runs, alpha_setup, key_client):
    checkpoint = services.checkpoint_record(
        model=alpha_setup.model, run=runs.first, step=2, path="/nowhere/2"
    )
    in_run = services.run_evaluation_record(run=runs.first, step=2, results=_used(360.0, "cpu", 50, (4, 1)),
                                            samples=[])  # fmt: skip
    standalone = services.evaluation_create(checkpoint=checkpoint, task_set=alpha_setup.task_set,
                                            environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    # A local reference used the worker too; a remote one sampled on someone else's endpoint.
    results = {**_used(36.0, "gpu", 20, (2, 0)), "reference": _used(72.0, "gpu", 30, (1, 1))}
    remote = services.evaluation_create(base_model=alpha_setup.base, task_set=alpha_setup.task_set,
                                        environment=alpha_setup.environment, reward=alpha_setup.reward)  # fmt: skip
    remote_results = {
        **_used(3.6, "cpu", 5, (0, 0)),
        "reference": {"completion_tokens": 999, "judge_prompt_tokens": 7},
    }
    Evaluation.objects.filter(pk=standalone.pk).update(results=results)
    Evaluation.objects.filter(pk=remote.pk).update(results=remote_results)

    run = key_client.get(f"/api/v1/runs/{runs.first.pk}/cost").json()
    assert (run["steps"], run["evaluations"], run["cpu_seconds"], run["sampled_tokens"]) == (
        2,
        1,
        5760.0,
        210,
    )
    assert run["judge_tokens"] == 18 + 5

    by_run = key_client.get("/api/v1/costs", {"group_by": "run"}).json()["data"]
    assert [(row["run"], row["evaluations"]) for row in by_run] == [
        (runs.first.pk, 1),
        (runs.second.pk, 0),
        (None, 2),
    ]
    standalone_row = by_run[-1]
    assert standalone_row["gpu_seconds"] == 108.0 and standalone_row["cpu_seconds"] == 3.6
    assert standalone_row["sampled_tokens"] == 20 + 30 + 5, "a remote reference's tokens are not ours"
    assert standalone_row["judge_tokens"] == 2 + 2 + 7, "its judge tokens are"
    by_model = key_client.get("/api/v1/costs", {"group_by": "model"}).json()["data"]
    assert [(row["model"], row["steps"], row["evaluations"]) for row in by_model] == [
        ("math/agent", 2, 2), ("math/second", 2, 0), (None, 0, 1)]  # fmt: skip
    assert in_run.run_id == runs.first.pk
