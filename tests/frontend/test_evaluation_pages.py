"""Dashboard scenario generation and evaluation pages through Django's test client: they call the
same services as the REST API (projects.services.scenarios, projects.services.evaluations); team
scoping (404), viewers (403), errors next to the field, the generation report, the queued
evaluation's page.

The cast (tests/conftest.py): alice owns alpha, bob is a viewer in alpha, charlie owns beta.
"""

from __future__ import annotations

import json

import pytest
from django.test import Client

from projects import services
from projects.models import Evaluation, EvaluationSample, EvaluationStatus, TaskRow, TaskSet
from projects.services import judges
from tests.openai_stub import openai_stub, tool_call

pytestmark = pytest.mark.django_db


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def row(prompt: str, answer: str) -> str:
    return json.dumps({"prompt": prompt, "item": {"answer": answer}})


@pytest.fixture
def writer(cast):
    """A team endpoint in front of the scripted OpenAI-compatible stub (tests/openai_stub.py)."""

    def make(replies):
        context = openai_stub(replies)
        stub = context.__enter__()
        contexts.append(context)
        endpoint = judges.judge_endpoint_create(
            team=cast.alpha,
            name="writer",
            base_url=stub.url,
            api_key="sk-writer",
            default_model="writer-model",
        )
        return stub, endpoint

    contexts: list = []
    yield make
    for context in contexts:
        context.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _scenario_jobs_run_at_once(monkeypatch):
    """The form queues a ScenarioJob for a worker; here the job runs as soon as it is queued."""
    from projects.services import scenarios

    monkeypatch.setattr(scenarios, "_enqueue_job", lambda job_id: scenarios.scenario_job_run(job_id=job_id))


def generate_form(setup, endpoint, **changes):
    data = {
        "environment": setup.environment.pk,
        "endpoint": endpoint.pk,
        "model": "",
        "n": "3",
        "instruction": "single-word answers",
        "name": "generated",
        "validation_fraction": "0",
    }
    data.update(changes)
    return data


# --- scenario generation ----------------------------------------------------------------------


def test_generate_saves_valid_rows_and_shows_the_report_on_the_new_task_set(cast, alpha_setup, writer):
    reply = "\n".join(
        [
            row("Say yes", "yes"),
            '{"prompt": "Say no", "item": ',
            row("Say maybe", "maybe"),
            row("say YES", "yes"),
        ]
    )
    stub, endpoint = writer([reply, row("Say later", "later")])
    client = client_for(cast.alice)
    url = f"/projects/{alpha_setup.project.pk}/task-sets/generate"
    response = client.post(url, generate_form(alpha_setup, endpoint))
    assert response.status_code == 302, response.content.decode()[:3000]
    created = TaskSet.objects.get(name="generated")
    # The form goes to the job's page; its polled part sends htmx on to the new task set.
    assert response["Location"].startswith("/scenario-jobs/")
    live = client.get(response["Location"] + "live", headers={"HX-Request": "true"})
    assert live["HX-Redirect"] == f"/task-sets/{created.pk}/"
    assert stub.requests[0]["model"] == "writer-model"
    assert created.row_count == 3
    html = client.get(live["HX-Redirect"]).content.decode()
    assert "Generated task set generated: 3 rows accepted, 2 rejected." in html
    assert '<dd class="accepted">3</dd>' in html and '<dd class="rejected">2</dd>' in html
    assert "malformed JSON" in html and "duplicate of accepted row 1" in html
    assert "Say maybe" in html  # the rows themselves
    project_html = client.get(f"/projects/{alpha_setup.project.pk}/").content.decode()
    assert f'href="/task-sets/{created.pk}/"' in project_html and "generated" in project_html


def test_generate_shows_the_reason_next_to_the_field_and_every_row_error(cast, alpha_setup, writer):
    stub, endpoint = writer(["[1, 2]", "nothing useful", '{"item": {}}'])
    client = client_for(cast.alice)
    url = f"/projects/{alpha_setup.project.pk}/task-sets/generate"
    response = client.post(url, generate_form(alpha_setup, endpoint), follow=True)
    assert response.status_code == 200
    job = response.context["job"]
    assert job.status == "failed" and "no valid task rows" in job.error
    assert [where for where, _ in job.problems][:2] == ["rows[1.1]", "rows[1.2]"]
    assert "Why no row was accepted" in response.content.decode()
    assert not TaskSet.objects.filter(name="generated").exists()
    # Input the service refuses up front is reported on its field and nothing is generated.
    requests_before = len(stub.requests)
    response = client.post(url, generate_form(alpha_setup, endpoint, name="qa", n="0"))
    errors = response.context["form"].errors
    assert "already exists" in errors["name"][0] or "from 1 to" in errors["n"][0]
    assert len(stub.requests) == requests_before


def test_generate_without_a_team_endpoint_explains_how_to_add_one(cast, alpha_setup):
    client = client_for(cast.alice)
    project_html = client.get(f"/projects/{alpha_setup.project.pk}/").content.decode()
    assert "disabled" in project_html and "Needs a team model endpoint" in project_html
    url = f"/projects/{alpha_setup.project.pk}/task-sets/generate"
    html = client.get(url).content.decode()
    assert "Your team has no model endpoint yet." in html and "/api/v1/judge-endpoints/" in html
    assert 'disabled aria-describedby="endpoint-needed"' in html
    response = client.post(url, {"name": "x", "instruction": "y", "n": "1", "validation_fraction": "0"})
    assert response.status_code == 200 and not TaskSet.objects.filter(name="x").exists()


def test_generate_is_for_members_of_the_team_only(cast, alpha_setup, writer):
    stub, endpoint = writer([row("Say ok", "ok")])
    url = f"/projects/{alpha_setup.project.pk}/task-sets/generate"
    bob = client_for(cast.bob)
    assert bob.get(url).status_code == 403
    assert bob.post(url, generate_form(alpha_setup, endpoint)).status_code == 403
    assert "Generate scenarios" not in bob.get(f"/projects/{alpha_setup.project.pk}/").content.decode()
    charlie = client_for(cast.charlie)
    assert charlie.get(url).status_code == 404
    assert charlie.post(url, generate_form(alpha_setup, endpoint)).status_code == 404
    assert charlie.get(f"/task-sets/{alpha_setup.task_set.pk}/").status_code == 404
    assert stub.requests == []
    # Another team's endpoint is not a choice in ours.
    theirs = judges.judge_endpoint_create(team=cast.beta, name="theirs", base_url="http://127.0.0.1:9/v1")
    response = client_for(cast.alice).post(url, generate_form(alpha_setup, theirs))
    assert "endpoint" in response.context["form"].errors


# --- evaluations -----------------------------------------------------------------------------


@pytest.fixture
def checkpoint(alpha_setup):
    return services.checkpoint_record(model=alpha_setup.model, run=None, step=0, path="/nowhere/step-0")


def evaluate_form(setup, subject, **changes):
    data = {
        "subject": subject,
        "task_set": setup.task_set.pk,
        "split": "validation",
        "environment": setup.environment.pk,
        "reward": setup.reward.pk,
        "reference": "",
        "reference_model": "",
        "pass_threshold": "1",
        "samples_per_row": "1",
        "max_rows": "",
        "temperature": "0",
        "max_new_tokens": "",
    }
    data.update(changes)
    return data


def test_evaluate_form_queues_a_job_enqueued_once_after_commit(
    cast, alpha_setup, checkpoint, django_capture_on_commit_callbacks
):
    client = client_for(cast.alice)
    html = client.get(f"/checkpoints/{checkpoint.pk}/").content.decode()
    assert "Evaluate this checkpoint" in html and f'value="checkpoint:{checkpoint.pk}" selected' in html
    form = evaluate_form(alpha_setup, f"checkpoint:{checkpoint.pk}", reference=f"base:{alpha_setup.base.pk}")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post("/evaluations/new", form)
    assert response.status_code == 302, response.content.decode()[:3000]
    evaluation = Evaluation.objects.get()
    assert response["Location"] == f"/evaluations/{evaluation.pk}/"
    assert len(callbacks) == 1, "the job is enqueued once, after the transaction commits"
    assert evaluation.status == EvaluationStatus.QUEUED and evaluation.checkpoint == checkpoint
    assert evaluation.reference_base_model == alpha_setup.base and evaluation.created_by == cast.alice
    html = client.get(response["Location"]).content.decode()
    assert "Evaluation 1 queued." in html.replace(str(evaluation.pk), "1")
    assert f'hx-get="/evaluations/{evaluation.pk}/live"' in html, "the page polls while queued"
    assert "math/agent:0" in html and "Cancel evaluation" in html and "2 validation rows" in html


def test_evaluate_form_shows_service_errors_next_to_the_field(cast, alpha_setup, checkpoint):
    client = client_for(cast.alice)
    subject = f"checkpoint:{checkpoint.pk}"
    only_train = services.task_set_create(
        project=alpha_setup.project, name="train-only", rows=[{"prompt": "x"}]
    )
    response = client.post("/evaluations/new", evaluate_form(alpha_setup, subject, task_set=only_train.pk))
    assert response.status_code == 200
    assert "no validation rows" in response.context["form"].errors["split"][0]
    response = client.post("/evaluations/new", evaluate_form(alpha_setup, subject, samples_per_row="0"))
    assert "samples_per_row" in response.context["form"].errors
    bare = judges.judge_endpoint_create(team=cast.alpha, name="bare", base_url="http://127.0.0.1:9/v1")
    response = client.post(
        "/evaluations/new", evaluate_form(alpha_setup, subject, reference=f"endpoint:{bare.pk}")
    )
    assert "name the model" in response.context["form"].errors["reference_model"][0]
    assert not Evaluation.objects.exists()


def test_evaluations_are_for_the_team_and_viewers_only_read(cast, alpha_setup, checkpoint):
    evaluation = Evaluation.objects.create(
        project=alpha_setup.project, checkpoint=checkpoint, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward,
    )  # fmt: skip
    bob = client_for(cast.bob)
    assert bob.get(f"/evaluations/{evaluation.pk}/").status_code == 200
    assert "Cancel evaluation" not in bob.get(f"/evaluations/{evaluation.pk}/").content.decode()
    assert bob.get("/evaluations/new").status_code == 403
    assert (
        bob.post("/evaluations/new", evaluate_form(alpha_setup, f"checkpoint:{checkpoint.pk}")).status_code
        == 403
    )
    assert bob.post(f"/evaluations/{evaluation.pk}/cancel").status_code == 403
    assert "Evaluate this checkpoint" not in bob.get(f"/checkpoints/{checkpoint.pk}/").content.decode()
    charlie = client_for(cast.charlie)
    for url in (
        f"/evaluations/{evaluation.pk}/",
        f"/evaluations/{evaluation.pk}/live",
        f"/evaluations/new?from={evaluation.pk}",
    ):
        assert charlie.get(url).status_code == 404, url
    assert charlie.post(f"/evaluations/{evaluation.pk}/cancel").status_code == 404
    assert f"#{evaluation.pk}<" not in charlie.get("/evaluations/").content.decode()
    assert f"#{evaluation.pk}<" in client_for(cast.alice).get("/evaluations/").content.decode()
    # Our checkpoint is not a choice for them.
    response = charlie.post("/evaluations/new", evaluate_form(alpha_setup, f"checkpoint:{checkpoint.pk}"))
    assert response.status_code == 200 and "subject" in response.context["form"].errors
    assert Evaluation.objects.count() == 1
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.QUEUED
    client_for(cast.alice).post(f"/evaluations/{evaluation.pk}/cancel")
    evaluation.refresh_from_db()
    assert evaluation.status == EvaluationStatus.CANCELLED


def _sample(evaluation, side, row_index, reward, answer, **metrics):
    return EvaluationSample.objects.create(
        evaluation=evaluation, side=side, task_row_index=row_index, reward=reward, sub_rewards={"exact": reward},
        messages=[
            {"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": "", "tool_calls": [tool_call("calculator", {"expression": "6*7"})]},
            {"role": "tool", "tool_call_id": "call_0", "content": "42"},
            {"role": "assistant", "content": answer},
        ],
        metrics={"turns": 2, **metrics},
    )  # fmt: skip


def test_finished_evaluation_shows_results_and_samples_side_by_side(cast, alpha_setup, checkpoint):
    evaluation = Evaluation.objects.create(
        project=alpha_setup.project, checkpoint=checkpoint, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward, reference_base_model=alpha_setup.base,
        status=EvaluationStatus.SUCCEEDED,
        results={
            "n": 2, "rows": 2, "reward_mean": 0.75, "pass_rate": 0.5, "pass_threshold": 1.0, "turns_mean": 2.0,
            "tool_calls": 2, "tool_errors": 0, "tool_error_rate": 0.0, "grader_means": {"exact": 0.75},
            "reference": {"n": 2, "reward_mean": 0.25, "pass_rate": 0.0, "grader_means": {"exact": 0.25}},
            "comparison": {"rows": 2, "wins": 1, "ties": 1, "losses": 0, "win_rate": 0.75, "reward_delta": 0.5},
        },
    )  # fmt: skip
    _sample(evaluation, "subject", 4, 1.0, "The answer is 42")
    _sample(evaluation, "reference", 4, 0.0, "The answer is 41")
    _sample(evaluation, "subject", 5, 0.5, "Same")
    _sample(evaluation, "reference", 5, 0.5, "Same")
    response = client_for(cast.alice).get(f"/evaluations/{evaluation.pk}/")
    html = response.content.decode()
    assert "hx-get" not in html.split('id="evaluation-live"')[1].split(">")[0], "a finished one is not polled"
    results = response.context["results"]
    by_key = {r["key"]: (r["subject"], r["reference"]) for r in results["rows"]}
    assert by_key["reward_mean"] == ("0.750", "0.250") and by_key["pass_rate"] == ("0.500", "0.000")
    assert by_key["turns_mean"] == ("2.00", "–") and by_key["tool_error_rate"] == ("0.000", "–")
    assert results["graders"] == [{"name": "exact", "subject": "0.750", "reference": "0.250"}]
    assert "Win rate vs reference" in html and '<strong class="win-rate">0.750</strong>' in html
    assert "Pass rate (reward ≥ 1)" in html
    rows = response.context["sample_rows"]
    assert [r.task_row_index for r in rows] == [4, 5]
    assert [c.side for c in rows[0].columns] == ["subject", "reference"]
    # Where the subject and the reference part ways (the transcript partial marks it).
    subject_answer = rows[0].columns[0].messages[3]
    assert subject_answer.first_divergence and [(p.text, p.diverged) for p in subject_answer.parts] == [
        ("The answer is 4", False),
        ("2", True),
    ]
    assert not any(m.first_divergence for c in rows[1].columns for m in c.messages), "equal rewards: no mark"
    assert "→ calculator" in html and "diverges here" in html and "Row 4" in html


def test_queued_evaluation_live_part_and_list_filters(cast, alpha_setup, checkpoint):
    evaluation = Evaluation.objects.create(
        project=alpha_setup.project, checkpoint=checkpoint, task_set=alpha_setup.task_set,
        environment=alpha_setup.environment, reward=alpha_setup.reward,
    )  # fmt: skip
    client = client_for(cast.alice)
    live = client.get(f"/evaluations/{evaluation.pk}/live").content.decode()
    assert live.startswith('<div id="evaluation-live" data-status="queued"') and "every 2s" in live
    assert "Results appear when the evaluation finishes." in live
    assert client.get("/evaluations/?status=queued").context["page"].paginator.count == 1
    assert client.get("/evaluations/?status=succeeded").context["page"].paginator.count == 0
    # "Evaluate again" prefills the form from the evaluation.
    form = client.get(f"/evaluations/new?from={evaluation.pk}").context["form"]
    assert (
        form.initial["subject"] == f"checkpoint:{checkpoint.pk}"
        and form.initial["task_set"] == alpha_setup.task_set.pk
    )


def test_generated_task_set_rows_are_stored(cast, alpha_setup, writer):
    """The dashboard's generated set is the service's: same rows, same report in ``source``."""
    _, endpoint = writer([row("Say one", "one")])
    client_for(cast.alice).post(
        f"/projects/{alpha_setup.project.pk}/task-sets/generate", generate_form(alpha_setup, endpoint, n="1")
    )
    created = TaskSet.objects.get(name="generated")
    assert created.source["type"] == "generated" and created.source["endpoint"] == "writer"
    assert [r.data["prompt"] for r in TaskRow.objects.filter(task_set=created)] == ["Say one"]


def _finished_evaluation(setup, checkpoint, rewards, *, pass_threshold=1.0):
    """A succeeded evaluation of ``checkpoint`` whose subject samples got ``rewards`` (one per row)."""
    passed = sum(reward >= pass_threshold for reward in rewards)
    evaluation = Evaluation.objects.create(
        project=setup.project, checkpoint=checkpoint, task_set=setup.task_set,
        environment=setup.environment, reward=setup.reward, status=EvaluationStatus.SUCCEEDED,
        pass_threshold=pass_threshold,
        results={
            "n": len(rewards), "rows": len(rewards), "reward_mean": sum(rewards) / len(rewards),
            "pass_rate": passed / len(rewards), "pass_threshold": pass_threshold,
        },
    )  # fmt: skip
    for index, reward in enumerate(rewards):
        _sample(evaluation, "subject", index, reward, "Paris")
    return evaluation


def test_evaluation_page_says_when_no_sample_reached_the_pass_threshold_and_the_best_reward(
    cast, alpha_setup, checkpoint
):
    # The demo's case: correct answers in a sentence earn 0.5, the threshold is 1.0.
    evaluation = _finished_evaluation(alpha_setup, checkpoint, [0.5] * 17 + [0.0] * 7)
    html = client_for(cast.alice).get(f"/evaluations/{evaluation.pk}/").content.decode()
    summary = html.split('class="pass-summary"')[1].split("</p>")[0]
    assert "No sample passed" in summary
    assert "0 of 24 samples reached the pass threshold (reward ≥ 1); the best reward was 0.5." in summary
    assert "Pass rate (reward ≥ 1)" in html  # the threshold beside the pass rate in the table


def test_evaluation_page_counts_the_samples_that_passed(cast, alpha_setup, checkpoint):
    evaluation = _finished_evaluation(alpha_setup, checkpoint, [1.0, 0.5, 0.5, 0.0], pass_threshold=0.5)
    html = client_for(cast.alice).get(f"/evaluations/{evaluation.pk}/").content.decode()
    summary = html.split('class="pass-summary"')[1].split("</p>")[0]
    assert 'data-passed="3"' in summary
    assert "3 of 4 samples reached the pass threshold (reward ≥ 0.5)." in summary
    assert "No sample passed" not in summary


def test_evaluation_tables_show_each_pass_rate_with_its_threshold(cast, alpha_setup, checkpoint):
    strict = _finished_evaluation(alpha_setup, checkpoint, [0.5, 0.5], pass_threshold=1.0)
    lenient = _finished_evaluation(alpha_setup, checkpoint, [0.5, 0.5], pass_threshold=0.5)
    html = client_for(cast.alice).get("/evaluations/").content.decode()
    cells = {
        evaluation.pk: html.split(f'data-evaluation="{evaluation.pk}"')[1]
        .split('class="pass-rate"')[1]
        .split("</td>")[0]
        for evaluation in (strict, lenient)
    }
    assert '<span class="rate">0.000</span>' in cells[strict.pk] and "at reward ≥ 1<" in cells[strict.pk]
    assert '<span class="rate">1.000</span>' in cells[lenient.pk] and "at reward ≥ 0.5<" in cells[lenient.pk]


def test_evaluation_event_names_the_pass_threshold():
    from projects.selectors import evaluation_results_summary

    line = evaluation_results_summary(
        {"reward_mean": 0.354, "pass_rate": 0.0, "n": 24, "pass_threshold": 1.0}
    )
    assert line == "reward 0.354, pass rate 0.000 (n=24, reward ≥ 1)"


def test_the_evaluate_form_of_a_runs_checkpoint_prefills_the_runs_pass_threshold(cast, alpha_setup):
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 2, "eval_pass_threshold": 0.5}, created_by=cast.alice,
    )  # fmt: skip
    checkpoint = services.checkpoint_record(model=alpha_setup.model, run=run, step=1, path="/nowhere/step-1")
    client = client_for(cast.alice)
    form = client.get(f"/evaluations/new?checkpoint={checkpoint.pk}").context["form"]
    assert form["pass_threshold"].value() == 0.5
    page_form = client.get(f"/checkpoints/{checkpoint.pk}/").context["evaluation_form"]
    assert page_form["pass_threshold"].value() == 0.5


def test_generate_shows_every_problem_of_the_input_at_once(cast, alpha_setup, writer):
    _, endpoint = writer([])
    client = client_for(cast.alice)
    url = f"/projects/{alpha_setup.project.pk}/task-sets/generate"
    taken = alpha_setup.task_set.name
    errors = client.post(url, generate_form(alpha_setup, endpoint, name=taken, n="0")).context["form"].errors
    assert "already exists" in errors["name"][0] and "from 1 to" in errors["n"][0]
    # A field the form itself refuses (empty) does not hide the service's problem with another.
    errors = (
        client.post(url, generate_form(alpha_setup, endpoint, name=taken, instruction=""))
        .context["form"]
        .errors
    )
    assert errors["instruction"] == ["This field is required."] and "already exists" in errors["name"][0]
