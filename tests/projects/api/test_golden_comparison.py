"""A golden comparison (issue 56): a fine-tuning job's newest checkpoint beside the model it replaces
(an old `ft:` model behind a team endpoint), on the job's rows, graded by the job's grader.
``POST /api/v1/evaluations`` with ``fine_tuning_job`` fills in what the request leaves out; the
dashboard's "Compare with another model…" on a run prefills the same. The evaluation itself (both
sides sampled and graded by the worker) is tests/integration/test_evaluations.py's."""

from __future__ import annotations

import io

import pytest

from projects import services
from projects.services import judges
from tests.conftest import error_of
from tests.projects.api.test_fine_tuning_api import (  # noqa: F401 (an autouse fixture: the openai client on WSGI)
    RL_ROWS,
    STRING_CHECK,
    _connection_kept_open,
    client_for,
    jsonl,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def ft(alpha_key, tiny_model_dir):
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    return client_for(alpha_key)


def _job(ft, *, validation: bool):
    train = ft.files.create(file=("t.jsonl", io.BytesIO(jsonl(RL_ROWS))), purpose="fine-tune")
    extra = {}
    if validation:
        valid = ft.files.create(file=("v.jsonl", io.BytesIO(jsonl(RL_ROWS[:2]))), purpose="fine-tune")
        extra["validation_file"] = valid.id
    job = ft.fine_tuning.jobs.create(
        model="tiny", training_file=train.id,
        method={"type": "reinforcement", "reinforcement": {"grader": STRING_CHECK}}, **extra,
    )  # fmt: skip
    from projects.models import Run

    return Run.objects.get(pk=int(job.id.removeprefix("ftjob-")))


def _old_model_endpoint(team):
    return judges.judge_endpoint_create(
        team=team, name="openai", base_url="http://127.0.0.1:9/v1", api_key="sk-old", default_model="gpt-4o-mini"
    )  # fmt: skip


def test_a_job_is_compared_with_the_model_it_replaces_on_its_held_out_rows_and_grader(alice_client, ft, cast):
    run = _job(ft, validation=True)
    endpoint = _old_model_endpoint(cast.alpha)
    body = {
        "fine_tuning_job": f"ftjob-{run.pk}",
        "reference": {"endpoint": endpoint.id, "model": "ft:gpt-4o-mini:acme::x1"},
    }

    # Before its first step the job has nothing to evaluate: a 400 that says so, not a 500.
    response = alice_client.post("/api/v1/evaluations", body, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "fine_tuning_job"
    assert "no step" in error_of(response)["message"]

    services.checkpoint_record(model=run.model, run=run, step=1, path="/nowhere/step-1")
    newest = services.checkpoint_record(model=run.model, run=run, step=2, path="/nowhere/step-2")
    response = alice_client.post("/api/v1/evaluations", body, format="json")
    assert response.status_code == 201, response.json()
    created = response.json()
    assert created["checkpoint"] == newest.pk and created["split"] == "validation"
    assert (created["task_set"], created["environment"], created["reward"]) == (
        run.task_set_id, run.environment_id, run.reward_id,
    )  # fmt: skip
    assert created["reference"] == {"endpoint": endpoint.id, "model": "ft:gpt-4o-mini:acme::x1"}
    assert "sk-old" not in response.content.decode()

    # What the request names wins over the job's: another checkpoint, every row.
    first = run.model.checkpoints.get(step=1)
    response = alice_client.post(
        "/api/v1/evaluations", {**body, "checkpoint": first.pk, "split": "all"}, format="json"
    )
    assert response.status_code == 201, response.json()
    assert response.json()["checkpoint"] == first.pk and response.json()["split"] == "all"


def test_a_job_without_a_validation_file_is_compared_on_every_row(alice_client, ft):
    run = _job(ft, validation=False)
    services.checkpoint_record(model=run.model, run=run, step=1, path="/nowhere/step-1")
    response = alice_client.post(
        "/api/v1/evaluations",
        {"fine_tuning_job": f"ftjob-{run.pk}", "reference": {"model": "tiny"}},
        format="json",
    )
    assert response.status_code == 201, response.json()
    assert response.json()["split"] == "all" and response.json()["reference"]["model"] == "tiny"


@pytest.mark.parametrize("job_id", ["ftjob-999999", "run-1", "ftjob-x"])
def test_an_unknown_job_is_a_400_naming_the_field(alice_client, job_id):
    response = alice_client.post("/api/v1/evaluations", {"fine_tuning_job": job_id}, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "fine_tuning_job"


def test_another_teams_job_is_unknown_and_without_a_job_the_inputs_are_required(
    alice_client, charlie_client, ft
):
    run = _job(ft, validation=False)
    services.checkpoint_record(model=run.model, run=run, step=1, path="/nowhere/step-1")
    response = charlie_client.post(
        "/api/v1/evaluations", {"fine_tuning_job": f"ftjob-{run.pk}"}, format="json"
    )
    assert response.status_code == 400 and error_of(response)["param"] == "fine_tuning_job"
    response = alice_client.post("/api/v1/evaluations", {"model": "tiny"}, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "task_set"


def test_the_run_page_offers_the_comparison_and_the_form_is_prefilled(ft, cast):
    from django.test import Client

    run = _job(ft, validation=True)
    newest = services.checkpoint_record(model=run.model, run=run, step=1, path="/nowhere/step-1")
    browser = Client()
    browser.force_login(cast.alice)
    page = browser.get(f"/runs/{run.pk}/").content.decode()
    assert f"/evaluations/new?run={run.pk}" in page
    form = browser.get(f"/evaluations/new?run={run.pk}").content.decode()
    assert f'value="checkpoint:{newest.pk}" selected' in form
    assert f'value="{run.reward_id}" selected' in form and f'value="{run.task_set_id}" selected' in form
