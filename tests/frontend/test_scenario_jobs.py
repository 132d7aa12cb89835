"""Scenario generation as a background job: the form checks its input and queues a ScenarioJob
(after commit, on the Celery task ``scenarios.generate``); the worker claims it once, writes rows
accepted / asked after each request, and ends with the task set or the reason; the job's page
polls until then and sends htmx on to the task set. Another team's job is a 404."""

from __future__ import annotations

import json

import pytest

from projects.jobs import tasks
from projects.models import ScenarioJob, ScenarioJobStatus, TaskSet
from projects.services import judges, scenarios
from tests.frontend.test_views import client_for
from tests.openai_stub import openai_stub

pytestmark = pytest.mark.django_db


def rows(*prompts: str) -> str:
    return "\n".join(json.dumps({"prompt": p, "item": {"answer": p.split()[-1]}}) for p in prompts)


def form(setup, endpoint, **changes):
    return {
        "environment": setup.environment.pk, "endpoint": endpoint.pk, "model": "", "n": "12",
        "instruction": "single-word answers", "name": "generated", "validation_fraction": "0", **changes,
    }  # fmt: skip


@pytest.fixture
def stub(cast):
    batch = rows(*(f"Say w{i}" for i in range(10)))
    with openai_stub([batch, rows("Say x1", "Say x2")]) as server:
        server.endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="writer", base_url=server.url, default_model="writer-model"
        )
        yield server


def test_the_form_queues_a_job_after_commit_and_asks_nothing_itself(
    cast, alpha_setup, stub, monkeypatch, django_capture_on_commit_callbacks
):
    sent: list[int] = []
    monkeypatch.setattr(tasks.generate_scenarios, "delay", lambda job_id: sent.append(job_id))
    client = client_for(cast.alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            f"/projects/{alpha_setup.project.pk}/task-sets/generate", form(alpha_setup, stub.endpoint)
        )
    job = ScenarioJob.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/scenario-jobs/{job.pk}/"
    assert sent == [job.pk] and stub.requests == []
    assert (job.status, job.rows_total, job.model) == (ScenarioJobStatus.QUEUED, 12, "writer-model")
    page = client.get(response["Location"]).content.decode()
    assert f'hx-get="/scenario-jobs/{job.pk}/live"' in page and "0 / 12 rows accepted" in page
    # Input refused up front: on its field, no job.
    refused = client.post(
        f"/projects/{alpha_setup.project.pk}/task-sets/generate", form(alpha_setup, stub.endpoint, name="qa")
    )
    assert refused.status_code == 200 and "already exists" in refused.context["form"].errors["name"][0]
    assert ScenarioJob.objects.count() == 1


def test_the_worker_records_progress_per_request_and_ends_with_the_task_set(
    cast, alpha_setup, stub, monkeypatch
):
    monkeypatch.setattr(scenarios, "_enqueue_job", lambda job_id: None)
    job = scenarios.scenario_job_create(
        project=alpha_setup.project, environment=alpha_setup.environment, endpoint=stub.endpoint,
        name="generated", instruction="single-word answers", n=12,
    )  # fmt: skip
    seen: list[tuple[int, int]] = []
    real_update = scenarios.ScenarioJob.objects.filter

    def progress_watch(*args, **kwargs):
        queryset = real_update(*args, **kwargs)
        if kwargs == {"pk": job.pk}:
            original = queryset.update

            def update(**fields):
                if "rows_done" in fields and "status" not in fields:
                    seen.append((fields["rows_done"], fields["requests_done"]))
                return original(**fields)

            queryset.update = update
        return queryset

    monkeypatch.setattr(scenarios.ScenarioJob.objects, "filter", progress_watch)
    assert tasks.generate_scenarios.name == "scenarios.generate"
    assert tasks.generate_scenarios.run(job.pk) == ScenarioJobStatus.SUCCEEDED
    assert seen == [(10, 1), (12, 2)]  # rows accepted / requests, after each request
    job.refresh_from_db()
    created = TaskSet.objects.get(name="generated")
    assert (job.status, job.task_set_id, job.rows_done, job.requests_done) == ("succeeded", created.pk, 12, 2)
    assert job.started_at and job.finished_at and job.attempts == 1
    # A duplicate delivery does nothing.
    assert scenarios.scenario_job_run(job_id=job.pk) == "not claimed"
    assert len(stub.requests) == 2
    client = client_for(cast.alice)
    live = client.get(f"/scenario-jobs/{job.pk}/live", headers={"HX-Request": "true"})
    assert live["HX-Redirect"] == f"/task-sets/{created.pk}/" and "hx-get" not in live.content.decode()
    assert (
        "Generated task set generated: 12 rows accepted, 0 rejected."
        in client.get(live["HX-Redirect"]).content.decode()
    )
    page = client.get(f"/scenario-jobs/{job.pk}/")
    assert "HX-Redirect" not in page and 'id="scenario-task-set"' in page.content.decode()
    # Opened only after the job had finished (a fast worker): the page still polls once, so the
    # browser moves on to the task set as it does mid-run (it used to stay on this page).
    assert f'hx-get="/scenario-jobs/{job.pk}/live"' in page.content.decode()


def test_a_job_without_a_valid_row_fails_with_the_per_row_errors(cast, alpha_setup, monkeypatch):
    monkeypatch.setattr(scenarios, "_enqueue_job", lambda job_id: None)
    with openai_stub(["[1, 2]", "nothing", "{}"]) as server:
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha, name="w", base_url=server.url, default_model="m"
        )
        job = scenarios.scenario_job_create(
            project=alpha_setup.project, environment=alpha_setup.environment, endpoint=endpoint,
            name="generated", instruction="anything", n=1,
        )  # fmt: skip
        assert scenarios.scenario_job_run(job_id=job.pk) == ScenarioJobStatus.FAILED
    job.refresh_from_db()
    assert job.status == "failed" and "no valid task rows" in job.error and job.finished_at
    assert job.problems and job.problems[0][0].startswith(("rows[", "requests["))
    html = client_for(cast.alice).get(f"/scenario-jobs/{job.pk}/").content.decode()
    assert 'id="scenario-error"' in html and "Why no row was accepted" in html and "hx-get" not in html
    assert not TaskSet.objects.filter(name="generated").exists()


def test_another_teams_job_is_a_404(cast, alpha_setup, stub, monkeypatch):
    monkeypatch.setattr(scenarios, "_enqueue_job", lambda job_id: None)
    job = scenarios.scenario_job_create(
        project=alpha_setup.project, environment=alpha_setup.environment, endpoint=stub.endpoint,
        name="generated", instruction="x", n=1,
    )  # fmt: skip
    charlie = client_for(cast.charlie)
    assert charlie.get(f"/scenario-jobs/{job.pk}/").status_code == 404
    assert charlie.get(f"/scenario-jobs/{job.pk}/live").status_code == 404
    assert client_for(cast.bob).get(f"/scenario-jobs/{job.pk}/").status_code == 200  # viewers read
