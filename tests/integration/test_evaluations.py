"""A real Celery worker evaluates: a run's validation split at step 0 and at the end, stored per
checkpoint, and a queued POST /api/v1/evaluations job against a reference checkpoint. A job whose
worker is SIGKILLed is taken over through its stale heartbeat and restarts from scratch."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from projects import services
from projects.models import (
    BaseModel,
    Evaluation,
    EvaluationEvent,
    EvaluationSample,
    EvaluationStatus,
    Run,
    RunStatus,
    TaskSet,
)
from tests.integration.conftest import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}
WORDS = ["a", "b", "c", "d", "e", "f"]


@pytest.fixture
def api(cast, alpha_key):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {alpha_key}")
    return client


@pytest.fixture
def inputs(cast, tiny_model_dir, api):
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    project = api.post("/api/v1/projects/", {"name": "ev"}, format="json").json()["id"]
    # Three validation rows (explicit split), three training rows.
    rows = [
        {"prompt": f"Say {word}", "item": {"answer": word}, **({"split": "validation"} if i % 2 else {})}
        for i, word in enumerate(WORDS)
    ]
    created = {
        "task_set": api.post(
            "/api/v1/task-sets/", {"project": project, "name": "words", "rows": rows}, format="json"
        ),
        "environment": api.post("/api/v1/environments/", {"project": project, "name": "chat"}, format="json"),
        "reward": api.post(
            "/api/v1/reward-definitions/",
            {"project": project, "name": "has-a", "spec": {"type": "regex", "pattern": "a"}},
            format="json",
        ),
        "model": api.post(
            "/api/v1/models/", {"project": project, "name": "m", "base_model": "tiny"}, format="json"
        ),
    }
    for name, response in created.items():
        assert response.status_code == 201, (name, response.json())
    return {name: response.json()["id"] for name, response in created.items()}


def test_run_evaluates_validation_rows_at_step_zero_and_at_the_end_then_a_queued_job(
    start_worker, api, inputs
):
    worker = start_worker()
    config = {"steps": 2, "group_size": 2, "groups_per_step": 2, "max_new_tokens": 6, "eval_max_rows": 2}
    body = {name: inputs[name] for name in ("model", "task_set", "environment", "reward")}
    response = api.post("/api/v1/runs/", {**body, "config": config}, format="json")
    assert response.status_code == 201, response.json()
    run_id = response.json()["id"]
    wait_for(
        lambda: Run.objects.get(pk=run_id).status in TERMINAL,
        timeout=240,
        what="the run to finish",
        worker=worker,
    )
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, worker.output()[-3000:])

    listed = api.get(f"/api/v1/runs/{run_id}/evaluations").json()["data"]
    assert [e["step"] for e in listed] == [0, 2], "step 0 (untrained) and the last step"
    for evaluation in listed:
        assert evaluation["status"] == "succeeded" and evaluation["model"] == f"ev/m:{evaluation['step']}"
        results = evaluation["results"]
        assert results["n"] == 2 and results["rows"] == 2, "eval_max_rows limits the rows"
        assert 0.0 <= results["reward_mean"] <= 1.0 and set(results["grader_means"]) == {"regex"}
        assert results["turns_mean"] == 1.0 and results["tool_error_rate"] is None
    final = listed[-1]["results"]
    assert final["baseline_step"] == 0 and final["comparison_to_baseline"]["rows"] == 2
    stored = Evaluation.objects.get(run=run, step=2)
    assert stored.checkpoint is not None and stored.checkpoint.step == 2
    samples = api.get(f"/api/v1/evaluations/{stored.pk}/samples/").json()["data"]
    assert sorted({s["task_row_index"] for s in samples}) == [1, 3], "the first validation rows by index"
    assert all(s["messages"][-1]["role"] == "assistant" for s in samples)

    # A queued job: the final checkpoint against the step-0 checkpoint, on every validation row.
    response = api.post(
        "/api/v1/evaluations",
        {**{k: body[k] for k in ("task_set", "environment", "reward")}, "model": "ev/m:latest",
         "samples_per_row": 2, "reference": {"model": "ev/m:0"}},
        format="json",
    )  # fmt: skip
    assert response.status_code == 201, response.json()
    job = response.json()
    assert job["model"] == "ev/m:2"
    wait_for(
        lambda: (
            Evaluation.objects.get(pk=job["id"]).status
            not in (EvaluationStatus.QUEUED, EvaluationStatus.RUNNING)
        ),
        timeout=180,
        what="the evaluation job",
        worker=worker,
    )
    detail = api.get(f"/api/v1/evaluations/{job['id']}/").json()
    assert detail["status"] == "succeeded", (detail["error"], worker.output()[-3000:])
    results = detail["results"]
    assert results["n"] == 3 * 2 and results["reference"]["n"] == 3 * 2
    comparison = results["comparison"]
    assert comparison["rows"] == 3 and comparison["wins"] + comparison["ties"] + comparison["losses"] == 3
    assert comparison["win_rate"] == pytest.approx((comparison["wins"] + 0.5 * comparison["ties"]) / 3)
    assert EvaluationSample.objects.filter(evaluation_id=job["id"], side="reference").count() == 6
    messages = [e["message"] for e in api.get(f"/api/v1/evaluations/{job['id']}/events/").json()["data"]]
    assert messages[0].startswith("Evaluation created") and any("started on worker" in m for m in messages)
    assert any("Loaded ev/m:2" in m for m in messages) and messages[-1].startswith("Evaluation succeeded")


def test_an_evaluation_job_that_cannot_load_its_model_fails_readably(
    start_worker, api, inputs, tiny_model_dir
):
    worker = start_worker()
    services.base_model_register(name="gone", source=str(tiny_model_dir.parent / "does-not-exist"))
    response = api.post(
        "/api/v1/evaluations",
        {
            "model": "gone",
            "task_set": inputs["task_set"],
            "environment": inputs["environment"],
            "reward": inputs["reward"],
        },
        format="json",
    )
    assert response.status_code == 201, response.json()
    evaluation_id = response.json()["id"]
    wait_for(
        lambda: Evaluation.objects.get(pk=evaluation_id).status == EvaluationStatus.FAILED,
        timeout=120,
        what="the failed evaluation",
        worker=worker,
    )
    detail = api.get(f"/api/v1/evaluations/{evaluation_id}/").json()
    assert "does-not-exist" in detail["error"] and "Traceback" not in detail["error"]
    events = api.get(f"/api/v1/evaluations/{evaluation_id}/events/").json()["data"]
    assert events[-1]["level"] == "error"


def test_a_base_model_against_a_team_endpoint_reference_in_the_worker(start_worker, api, inputs, cast):
    from django.conf import settings

    from projects.services import judges
    from tests.openai_stub import openai_stub

    # The worker decrypts the endpoint's key with the installation's SECRET_KEY, as in production.
    worker = start_worker(SECRET_KEY=settings.SECRET_KEY)
    with openai_stub([lambda body: "a"] * 20) as stub:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="external", base_url=stub.url, api_key="sk-external"
        )
        response = api.post(
            "/api/v1/evaluations",
            {"model": "tiny", "task_set": inputs["task_set"], "environment": inputs["environment"],
             "reward": inputs["reward"], "reference": {"endpoint": endpoint.id, "model": "gpt-ref"}},
            format="json",
        )  # fmt: skip
        assert response.status_code == 201, response.json()
        evaluation_id = response.json()["id"]
        wait_for(
            lambda: (
                Evaluation.objects.get(pk=evaluation_id).status
                not in (EvaluationStatus.QUEUED, EvaluationStatus.RUNNING)
            ),
            timeout=120,
            what="the evaluation against the endpoint",
            worker=worker,
        )
    detail = api.get(f"/api/v1/evaluations/{evaluation_id}/").json()
    assert detail["status"] == "succeeded", (detail["error"], worker.output()[-3000:])
    reference = detail["results"]["reference"]
    assert (
        reference["model"] == "external:gpt-ref" and reference["reward_mean"] == 1.0 and reference["n"] == 3
    )
    comparison = detail["results"]["comparison"]
    assert comparison["wins"] == 0 and comparison["rows"] == 3, "nothing beats a perfect reference"
    assert len(stub.requests) == 3 and {r["model"] for r in stub.requests} == {"gpt-ref"}
    assert all(h["Authorization"] == "Bearer sk-external" for h in stub.headers)
    asked = {r["messages"][-1]["content"] for r in stub.requests}
    assert asked == {"Say b", "Say d", "Say f"}, "the validation rows, each asked once"


def test_killed_worker_evaluation_restarts_from_scratch_with_each_sample_once(
    start_worker, api, inputs, cast
):
    from django.conf import settings

    from projects.services import judges
    from tests.openai_stub import openai_stub

    # The reference endpoint holds every reply until `gate` opens: the first worker is then
    # deterministically mid-evaluation (subject done, reference in flight) when it is killed.
    gate = threading.Event()

    def held(body):
        gate.wait(timeout=120)
        return "a"

    first = start_worker(SECRET_KEY=settings.SECRET_KEY)  # the worker decrypts the endpoint's key
    with openai_stub([held] * 40) as stub:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="held", base_url=stub.url, api_key="sk-held"
        )
        response = api.post(
            "/api/v1/evaluations",
            {"model": "tiny", "task_set": inputs["task_set"], "environment": inputs["environment"],
             "reward": inputs["reward"], "samples_per_row": 2,
             "reference": {"endpoint": endpoint.id, "model": "gpt-ref"}},
            format="json",
        )  # fmt: skip
        assert response.status_code == 201, response.json()
        evaluation_id = response.json()["id"]
        wait_for(lambda: stub.requests, timeout=120, what="the reference phase", worker=first)
        claimed = Evaluation.objects.get(pk=evaluation_id)
        assert claimed.status == EvaluationStatus.RUNNING and claimed.heartbeat_at is not None

        # Alive though stuck longer than the heartbeat timeout (4 s): its heartbeat keeps it.
        time.sleep(6)
        live = Evaluation.objects.get(pk=evaluation_id)
        assert live.worker == claimed.worker and live.heartbeat_at > claimed.heartbeat_at
        assert services.evaluations_requeue_orphaned(stale_after_s=4) == []

        first.kill()
        wait_for(
            lambda: (
                timezone.now() - Evaluation.objects.get(pk=evaluation_id).heartbeat_at
                > timedelta(seconds=4.5)
            ),
            timeout=30,
            what="the dead worker's heartbeat to go stale",
        )
        assert Evaluation.objects.get(pk=evaluation_id).status == EvaluationStatus.RUNNING
        # The beat task's work, run here: the orphan goes back on the queue.
        assert services.evaluations_requeue_orphaned(stale_after_s=4) == [evaluation_id]
        gate.set()  # the endpoint answers from now on
        second = start_worker(SECRET_KEY=settings.SECRET_KEY)
        wait_for(
            lambda: (
                Evaluation.objects.get(pk=evaluation_id).status
                not in (EvaluationStatus.QUEUED, EvaluationStatus.RUNNING)
            ),
            timeout=180,
            what="the restarted evaluation",
            worker=second,
        )
    evaluation = Evaluation.objects.get(pk=evaluation_id)
    assert evaluation.status == EvaluationStatus.SUCCEEDED, (evaluation.error, second.output()[-3000:])
    assert evaluation.worker != claimed.worker
    assert evaluation.results["n"] == 6 and evaluation.results["reference"]["n"] == 6
    assert evaluation.results["reference"]["reward_mean"] == 1.0
    recorded = sorted(
        EvaluationSample.objects.filter(evaluation=evaluation).values_list(
            "side", "task_row_index", "sample_index"
        )
    )
    expected = sorted(
        (side, row, sample) for side in ("reference", "subject") for row in (1, 3, 5) for sample in (0, 1)
    )
    assert recorded == expected, "each sample recorded exactly once"
    messages = list(
        EvaluationEvent.objects.filter(evaluation=evaluation).order_by("id").values_list("message", flat=True)
    )
    restarts = [m for m in messages if "stopped sending heartbeats; restarting from scratch" in m]
    assert len(restarts) == 1 and claimed.worker in restarts[0], messages
    assert sum(m.startswith("Evaluation succeeded") for m in messages) == 1


def test_claim_takes_over_only_a_stale_evaluation_and_deletes_its_partial_samples(inputs):
    task_set = TaskSet.objects.get(pk=inputs["task_set"])
    evaluation = Evaluation.objects.create(  # as evaluation_create makes it, without enqueueing it
        project=task_set.project,
        task_set=task_set,
        environment_id=inputs["environment"],
        reward_id=inputs["reward"],
        base_model=BaseModel.objects.get(name="tiny"),
    )
    assert services.evaluation_claim(evaluation_id=evaluation.pk, worker="w1") is not None
    assert services.evaluation_claim(evaluation_id=evaluation.pk, worker="w2") is None, "w1 is alive"
    assert services.evaluation_heartbeat(evaluation_id=evaluation.pk, worker="w1")
    assert not services.evaluation_heartbeat(evaluation_id=evaluation.pk, worker="w2")
    EvaluationSample.objects.create(evaluation=evaluation, task_row_index=1, messages=[], reward=1.0)
    Evaluation.objects.filter(pk=evaluation.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=60))

    taken = services.evaluation_claim(evaluation_id=evaluation.pk, worker="w2", stale_after_s=30)
    assert taken is not None and taken.worker == "w2" and taken.status == EvaluationStatus.RUNNING
    assert not EvaluationSample.objects.filter(evaluation=evaluation).exists(), "restarts from scratch"
    assert not services.evaluation_heartbeat(evaluation_id=evaluation.pk, worker="w1"), "w1 must stop"
    assert services.evaluation_claim(evaluation_id=evaluation.pk, worker="w3", stale_after_s=30) is None
