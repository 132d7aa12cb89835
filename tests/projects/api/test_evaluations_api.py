"""POST /api/v1/evaluations and its reads: happy path, bad input 400 naming the field, outsiders 404,
viewers and read-only keys 403; the services behind it (claim, finish, cancel, run evaluations)."""

from __future__ import annotations

import pytest

from projects import services
from projects.models import Evaluation, EvaluationSample, EvaluationStatus, Run
from projects.services import judges
from tests.conftest import error_of
from training.runs.evaluation import EvalSample

pytestmark = pytest.mark.django_db


@pytest.fixture
def setup(alpha_setup):
    checkpoint = services.checkpoint_record(model=alpha_setup.model, run=None, step=0, path="/nowhere/step-0")
    alpha_setup.checkpoint = checkpoint
    return alpha_setup


def body(setup, **changes):
    data = {
        "model": "math/agent:0",
        "task_set": setup.task_set.id,
        "environment": setup.environment.id,
        "reward": setup.reward.id,
    }
    data.update(changes)
    return data


def test_create_queues_a_job_with_an_event_and_enqueues_after_commit(
    alice_client, setup, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = alice_client.post("/api/v1/evaluations", body(setup, samples_per_row=2), format="json")
    assert response.status_code == 201, response.json()
    created = response.json()
    assert created["object"] == "evaluation" and created["status"] == "queued"
    assert created["model"] == "math/agent:0" and created["checkpoint"] == setup.checkpoint.id
    assert created["split"] == "validation" and created["samples_per_row"] == 2
    assert created["config"]["temperature"] == 0.0 and created["reference"] is None
    assert len(callbacks) == 1, "the job is enqueued once, after the transaction commits"

    detail = alice_client.get(f"/api/v1/evaluations/{created['id']}/").json()
    assert detail["id"] == created["id"]
    events = alice_client.get(f"/api/v1/evaluations/{created['id']}/events/").json()
    assert events["object"] == "list" and "2 validation rows" in events["data"][0]["message"]
    listed = alice_client.get(f"/api/v1/evaluations/?checkpoint={setup.checkpoint.id}").json()
    assert [e["id"] for e in listed["data"]] == [created["id"]]
    assert alice_client.get(f"/api/v1/evaluations/{created['id']}/samples/").json()["data"] == []


def test_a_base_model_with_a_checkpoint_reference_and_an_endpoint_reference(alice_client, setup, cast):
    response = alice_client.post(
        "/api/v1/evaluations/",
        body(setup, model="tiny", split="all", reference={"checkpoint": setup.checkpoint.id}),
        format="json",
    )
    assert response.status_code == 201, response.json()
    created = response.json()
    assert created["model"] == "tiny" and created["checkpoint"] is None
    assert created["reference"] == {"checkpoint": setup.checkpoint.id, "model": "math/agent:0"}

    endpoint = judges.judge_endpoint_create(
        team=cast.alpha,
        name="other",
        base_url="http://127.0.0.1:9/v1",
        api_key="sk-secret",
        default_model="gpt-x",
    )
    response = alice_client.post(
        "/api/v1/evaluations/", body(setup, reference={"endpoint": endpoint.id}), format="json"
    )
    assert response.status_code == 201, response.json()
    assert response.json()["reference"] == {"endpoint": endpoint.id, "model": "gpt-x"}
    assert "sk-secret" not in response.content.decode()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"split": "test"}, "split"),
        ({"model": "math/agent:9"}, "model"),
        ({"model": None}, "model"),
        ({"samples_per_row": 0}, "samples_per_row"),
        ({"temperature": -1}, "temperature"),
        ({"max_rows": 0}, "max_rows"),
        ({"task_set": 999999}, "task_set"),
        ({"reference": {"checkpoint": 999999}}, "reference.checkpoint"),
        ({"reference": {"model": "nope/nope:1"}}, "reference.model"),
        ({"reference": {"checkpoint": 1, "model": "tiny"}}, "reference"),
    ],
)
def test_bad_input_is_400_naming_the_field(alice_client, setup, changes, field):
    data = body(setup, **changes)
    if data.get("model") is None:
        data.pop("model")
    response = alice_client.post("/api/v1/evaluations/", data, format="json")
    assert response.status_code == 400, response.json()
    assert error_of(response)["param"] == field


def test_both_model_and_checkpoint_or_a_split_without_rows_are_400(alice_client, setup, cast):
    response = alice_client.post(
        "/api/v1/evaluations/", body(setup, checkpoint=setup.checkpoint.id), format="json"
    )
    assert error_of(response)["param"] == "model"
    only_train = services.task_set_create(project=setup.project, name="train-only", rows=[{"prompt": "x"}])
    response = alice_client.post("/api/v1/evaluations/", body(setup, task_set=only_train.id), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "split"
    assert "no validation rows" in error_of(response)["message"]
    endpoint = judges.judge_endpoint_create(team=cast.alpha, name="bare", base_url="http://127.0.0.1:9/v1")
    response = alice_client.post(
        "/api/v1/evaluations/", body(setup, reference={"endpoint": endpoint.id}), format="json"
    )
    assert error_of(response)["param"] == "reference.model"


def test_outsiders_get_404_and_cannot_use_our_objects(alice_client, charlie_client, setup):
    created = alice_client.post("/api/v1/evaluations/", body(setup), format="json").json()
    for path in ("", "samples/", "events/"):
        response = charlie_client.get(f"/api/v1/evaluations/{created['id']}/{path}")
        assert response.status_code == 404, path
    assert charlie_client.post(f"/api/v1/evaluations/{created['id']}/cancel/").status_code == 404
    assert charlie_client.get("/api/v1/evaluations/").json()["data"] == []
    # Our model id and our task set read as unknown to them.
    response = charlie_client.post("/api/v1/evaluations/", body(setup), format="json")
    assert response.status_code == 400 and error_of(response)["param"] in {"model", "task_set"}
    response = charlie_client.post(
        "/api/v1/evaluations/", body(setup, model=None, checkpoint=setup.checkpoint.id), format="json"
    )
    assert response.status_code == 400


def test_viewers_and_read_only_keys_cannot_write_but_can_read(
    alice_client, bob_client, read_only_client, setup
):
    created = alice_client.post("/api/v1/evaluations/", body(setup), format="json").json()
    for client in (bob_client, read_only_client):
        assert client.post("/api/v1/evaluations/", body(setup), format="json").status_code == 403
        assert client.post(f"/api/v1/evaluations/{created['id']}/cancel/").status_code == 403
        assert client.get(f"/api/v1/evaluations/{created['id']}/").status_code == 200
    assert (
        error_of(bob_client.post("/api/v1/evaluations/", body(setup), format="json"))["type"]
        == "permission_error"
    )


def test_cancel_a_queued_evaluation_then_conflict(alice_client, setup):
    created = alice_client.post("/api/v1/evaluations/", body(setup), format="json").json()
    response = alice_client.post(f"/api/v1/evaluations/{created['id']}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    again = alice_client.post(f"/api/v1/evaluations/{created['id']}/cancel/")
    assert again.status_code == 409
    # A worker that picks up the cancelled job does nothing.
    assert services.evaluation_claim(evaluation_id=created["id"], worker="w1") is None


def sample(side: str, row: int, reward: float) -> EvalSample:
    return EvalSample(side, row, 0, [{"role": "assistant", "content": "x\x00"}], reward, {"exact": reward})


def test_claim_is_idempotent_and_finish_needs_the_owner(alice_client, setup):
    created = alice_client.post("/api/v1/evaluations/", body(setup), format="json").json()
    claimed = services.evaluation_claim(evaluation_id=created["id"], worker="w1")
    assert claimed is not None and claimed.status == EvaluationStatus.RUNNING
    assert services.evaluation_claim(evaluation_id=created["id"], worker="w2") is None, "duplicate delivery"
    assert not services.evaluation_finish(evaluation_id=created["id"], worker="w2", results={}, samples=[])
    assert services.evaluation_finish(
        evaluation_id=created["id"],
        worker="w1",
        results={"reward_mean": 0.5, "pass_rate": 0.5, "n": 2},
        samples=[sample("subject", 1, 1.0), sample("subject", 3, 0.0)],
    )
    detail = alice_client.get(f"/api/v1/evaluations/{created['id']}/").json()
    assert detail["status"] == "succeeded" and detail["results"]["reward_mean"] == 0.5
    samples = alice_client.get(f"/api/v1/evaluations/{created['id']}/samples/?side=subject").json()["data"]
    assert [(s["task_row_index"], s["reward"]) for s in samples] == [(1, 1.0), (3, 0.0)]
    assert samples[0]["messages"][0]["content"] == "x\ufffd", "NUL is replaced, not a failed write"
    messages = [
        e["message"] for e in alice_client.get(f"/api/v1/evaluations/{created['id']}/events/").json()["data"]
    ]
    assert any("succeeded: reward 0.500, pass rate 0.500" in m for m in messages), messages
    assert services.evaluation_fail(evaluation_id=created["id"], error="late") is False


def test_failed_evaluation_keeps_a_readable_error(alice_client, setup):
    created = alice_client.post("/api/v1/evaluations/", body(setup), format="json").json()
    services.evaluation_claim(evaluation_id=created["id"], worker="w1")
    services.evaluation_fail(evaluation_id=created["id"], error="ModelLoadError: model directory missing")
    detail = alice_client.get(f"/api/v1/evaluations/{created['id']}/").json()
    assert detail["status"] == "failed" and "model directory missing" in detail["error"]


def test_run_evaluations_are_stored_per_checkpoint_once_and_listed_on_the_run(
    alice_client, charlie_client, setup
):
    run = services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward
    )
    results = {
        "reward_mean": 0.25,
        "pass_rate": 0.0,
        "n": 2,
        "grader_means": {"exact": 0.25},
        "seconds": 31.0,
    }
    first = services.run_evaluation_record(
        run=run, step=0, results=results, samples=[sample("subject", 1, 0.5), sample("subject", 3, 0.0)]
    )
    again = services.run_evaluation_record(run=run, step=0, results={}, samples=[])
    assert again.pk == first.pk and EvaluationSample.objects.filter(evaluation=first).count() == 2
    assert first.checkpoint == setup.checkpoint and first.status == EvaluationStatus.SUCCEEDED
    assert first.max_rows == 8 and first.pass_threshold == 1.0
    # It ran for the seconds its results say, ending when it was recorded (not a zero-length span).
    assert (first.finished_at - first.started_at).total_seconds() == pytest.approx(31.0)
    # ... and was created when it started, not "created" 31 s after it started.
    stored = Evaluation.objects.get(pk=first.pk)
    assert stored.created_at == stored.started_at == first.created_at
    listed = alice_client.get(f"/api/v1/runs/{run.id}/evaluations").json()["data"]
    assert [(e["step"], e["results"]["reward_mean"]) for e in listed] == [(0, 0.25)]
    assert listed[0]["model"] == "math/agent:0"
    assert alice_client.get(f"/api/v1/evaluations/?run={run.id}").json()["data"][0]["id"] == first.pk
    assert charlie_client.get(f"/api/v1/runs/{run.id}/evaluations").status_code == 404
    by_checkpoint = alice_client.get(f"/api/v1/checkpoints/{setup.checkpoint.id}/evaluations").json()["data"]
    assert [e["id"] for e in by_checkpoint] == [first.pk]
    assert charlie_client.get(f"/api/v1/checkpoints/{setup.checkpoint.id}/evaluations").status_code == 404
    # A later step is compared with the run's first evaluation on the same rows: row 1 improved
    # (1.0 vs 0.5, a win), row 3 did not (0.0 vs 0.0, a tie counting half).
    services.checkpoint_record(model=setup.model, run=run, step=2, path="/nowhere/step-2")
    later = services.run_evaluation_record(
        run=run,
        step=2,
        results={"reward_mean": 0.5},
        samples=[sample("subject", 1, 1.0), sample("subject", 3, 0.0)],
    )
    assert later.checkpoint.step == 2 and later.results["baseline_step"] == 0
    assert later.results["comparison_to_baseline"] == {
        "rows": 2, "wins": 1, "ties": 1, "losses": 0, "win_rate": 0.75, "reward_delta": 0.25,
    }  # fmt: skip
    assert "win rate vs step 0 0.750" in Run.objects.get(pk=run.pk).events.last().message
    assert "comparison_to_baseline" not in first.results
    event = Run.objects.get(pk=run.pk).events.filter(message__startswith="Evaluation at step 0").first()
    assert event is not None and event.data["reward_mean"] == 0.25
    assert Evaluation.objects.filter(run=run).count() == 2


def test_an_evaluation_of_a_runs_checkpoint_passes_at_the_runs_threshold_by_default(alice_client, setup):
    """The CLI posts the body as written: without pass_threshold, a run's checkpoint is graded at
    the run's eval_pass_threshold (the demo's 0.5), not 1.0; a base model at TrainConfig's 1.0."""
    run = services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward,
        config={"eval_pass_threshold": 0.5},
    )  # fmt: skip
    services.checkpoint_record(model=setup.model, run=run, step=1, path="/nowhere/step-1")
    created = alice_client.post("/api/v1/evaluations/", body(setup, model="math/agent:1"), format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["pass_threshold"] == 0.5
    given = alice_client.post(
        "/api/v1/evaluations/", body(setup, model="math/agent:1", pass_threshold=0.75), format="json"
    )
    assert given.json()["pass_threshold"] == 0.75
    without_run = alice_client.post("/api/v1/evaluations/", body(setup), format="json").json()
    assert without_run["pass_threshold"] == 1.0
