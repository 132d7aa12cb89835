"""The new-run form forgives: an existing task set is selected, an upload survives a later error
(saved and selected) or the page says to choose the file again, and the form and the run page say
where a run starts (the model's latest checkpoint or its base model)."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from projects import services
from projects.models import Run, TaskSet
from tests import factories
from tests.frontend.test_views import _run_form, client_for

pytestmark = pytest.mark.django_db

ROWS = b'{"prompt": "a", "item": {"answer": "a"}}\n{"prompt": "b", "item": {"answer": "b"}}\n'


@pytest.fixture(autouse=True)
def _no_enqueue(monkeypatch):
    monkeypatch.setattr(services.runs, "_enqueue_run", lambda run_id: None)


def new_run_url(setup) -> str:
    return f"/projects/{setup.project.pk}/runs/new"


def test_the_form_selects_the_newest_existing_task_set(cast, alpha_setup):
    newer = factories.TaskSetFactory(project=alpha_setup.project, name="newer")
    form = client_for(cast.alice).get(new_run_url(alpha_setup)).context["form"]
    assert form["task_set"].value() == newer.pk
    html = str(form["task_set"])
    assert f'<option value="{newer.pk}" selected>' in html


def test_an_upload_survives_an_error_after_it_was_saved(cast, alpha_setup):
    client = client_for(cast.alice)
    data = _run_form(alpha_setup, task_set="", task_set_name="uploaded", hp_group_size="1")
    data["task_file"] = SimpleUploadedFile("rows.jsonl", ROWS)
    response = client.post(new_run_url(alpha_setup), data)
    assert response.status_code == 200 and not Run.objects.exists()
    form = response.context["form"]
    uploaded = TaskSet.objects.get(name="uploaded")
    assert str(form["task_set"].value()) == str(uploaded.pk)  # selected: no need to upload it again
    assert "at least 2" in form.errors["hp_group_size"][0]
    assert any("“uploaded” was saved" in e for e in form.non_field_errors())
    # Fixing the one field and sending the page again starts the run on the saved upload.
    again = client.post(new_run_url(alpha_setup), {**form.data.dict(), "hp_group_size": "4"})
    assert again.status_code == 302, again.context["form"].errors
    assert Run.objects.get().task_set == uploaded


def test_a_bad_upload_asks_for_the_file_again(cast, alpha_setup):
    data = _run_form(alpha_setup, task_set="", task_set_name="uploaded")
    data["task_file"] = SimpleUploadedFile("rows.jsonl", b"not json\n")
    response = client_for(cast.alice).post(new_run_url(alpha_setup), data)
    errors = response.context["form"].errors["task_file"]
    assert any(e.startswith("line 1:") for e in errors)
    assert any("choose it again" in e for e in errors)


def test_the_form_and_the_run_page_say_where_the_run_starts(cast, alpha_setup):
    client = client_for(cast.alice)
    labels = dict(client.get(new_run_url(alpha_setup)).context["form"].fields["model"].choices)
    assert labels[alpha_setup.model.pk].endswith("starts from the base model")
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 2}, created_by=cast.alice,
    )  # fmt: skip
    assert "Will start from the base model" in client.get(f"/runs/{run.pk}/").content.decode()

    factories.CheckpointFactory(model=alpha_setup.model, step=20)
    labels = dict(client.get(new_run_url(alpha_setup)).context["form"].fields["model"].choices)
    assert labels[alpha_setup.model.pk].endswith("continues from checkpoint step 20")
    # Where a run starts is fixed when it is created (services.run_create, start_from).
    assert "Will start from the base model" in client.get(f"/runs/{run.pk}/").content.decode()
    services.run_cancel(run=run)
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 2}, created_by=cast.alice,
    )  # fmt: skip
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "Will continue from checkpoint step 20" in page

    Run.objects.filter(pk=run.pk).update(started_at="2026-01-01T00:00:00Z")
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "Continued from checkpoint step 20 (model steps 20 to 22)" in page


def test_the_playground_takes_the_environment_prompt_and_the_run_settings(cast, alpha_setup):
    environment = alpha_setup.environment
    environment.system_prompt = "Answer in French.\nBriefly."
    environment.save()
    run = services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=environment,
        reward=alpha_setup.reward, config={"steps": 2, "max_new_tokens": 48, "eval_temperature": 0.0},
        created_by=cast.alice,
    )  # fmt: skip
    checkpoint = factories.CheckpointFactory(model=alpha_setup.model, run=run, step=1)
    html = client_for(cast.alice).get(f"/checkpoints/{checkpoint.pk}/").content.decode()
    assert '<textarea id="pg-system" rows="2">Answer in French.\nBriefly.</textarea>' in html
    assert 'id="pg-max-tokens" type="number" min="1" max="4096" value="48"' in html
    assert 'id="pg-temperature" type="number" min="0" max="2" step="0.1" value="0"' in html
    assert f"Prefilled as run #{run.pk}" in html


def test_an_uploaded_file_wins_over_the_preselected_task_set_and_the_message_says_so(cast, alpha_setup):
    client = client_for(cast.alice)
    data = _run_form(alpha_setup, task_set_name="uploaded")  # the list keeps alpha's task set
    data["task_file"] = SimpleUploadedFile("rows.jsonl", ROWS)
    response = client.post(new_run_url(alpha_setup), data, follow=True)
    run = Run.objects.get()
    assert run.task_set == TaskSet.objects.get(name="uploaded") != alpha_setup.task_set
    assert run.task_set.row_count == 2
    (message,) = [str(m) for m in response.context["messages"]]
    assert "on the uploaded task set “uploaded” (2 train / 0 validation rows)" in message
    assert f"the selected task set “{alpha_setup.task_set.name}” was not used" in message


def test_a_file_and_a_task_set_without_a_name_asks_for_the_name_and_the_file_again(cast, alpha_setup):
    data = _run_form(alpha_setup, task_set_name="")  # a task set selected, a file, no name
    data["task_file"] = SimpleUploadedFile("rows.jsonl", ROWS)
    response = client_for(cast.alice).post(new_run_url(alpha_setup), data)
    assert response.status_code == 200 and not Run.objects.exists()
    errors = response.context["form"].errors
    assert errors["task_set_name"] == ["name the uploaded task set"]
    assert any("choose it again" in e for e in errors["task_file"])


def test_every_hyperparameter_says_its_default_and_the_form_where_they_come_from(cast, alpha_setup):
    from projects import catalog

    response = client_for(cast.alice).get(new_run_url(alpha_setup))
    form = response.context["form"]
    for name, spec in catalog.hyperparameters().items():
        field = form[f"hp_{name}"]
        assert field.initial == spec["default"], name
        default = spec["default"]
        shown = {"None": "empty", "True": "on", "False": "off"}.get(str(default), str(default))
        assert field.help_text.endswith(f"Default: {shown}."), (name, field.help_text)
    # The learning rate is left empty: the run gets the default for its base model's width.
    assert (
        form["hp_learning_rate"].initial is None and "Default: empty." in form["hp_learning_rate"].help_text
    )
    assert "base model's width" in form["hp_learning_rate"].help_text
    html = response.content.decode()
    assert "training/config.py" in html and "GET /api/v1/hyperparameters" in html
    assert "artweb/demo/__init__.py" in html  # the demo's own values, and where they are


def test_the_form_starts_an_sft_run_and_says_which_row_lacks_its_target(cast, alpha_setup):
    client = client_for(cast.alice)
    response = client.post(new_run_url(alpha_setup), _run_form(alpha_setup, kind="sft"))
    assert response.status_code == 200 and not Run.objects.exists()
    (error,) = response.context["form"].errors["task_set"]
    assert "cannot train a sft run" in error and "completion" in error
    targets = services.task_set_create(project=alpha_setup.project, name="targets",
                                       rows=[{"prompt": "a", "completion": "b"}])  # fmt: skip
    response = client.post(
        new_run_url(alpha_setup), _run_form(alpha_setup, kind="sft", task_set=str(targets.pk))
    )
    assert response.status_code == 302, response.context["form"].errors
    run = Run.objects.get()
    assert run.kind == "sft" and run.task_set == targets
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "SFT run" in page


def test_a_bad_upload_and_a_bad_hyperparameter_are_shown_in_one_submit(cast, alpha_setup):
    data = _run_form(alpha_setup, task_set="", task_set_name="uploaded", hp_steps="-3")
    data["task_file"] = SimpleUploadedFile("rows.jsonl", b'{"prompt": "a"}\nnot json\n')
    response = client_for(cast.alice).post(new_run_url(alpha_setup), data)
    assert (
        response.status_code == 200
        and not Run.objects.exists()
        and not TaskSet.objects.filter(name="uploaded").exists()
    )
    errors = response.context["form"].errors
    assert any(e.startswith("line 2:") for e in errors["task_file"])
    assert errors["hp_steps"], errors  # not hidden until the next submit


def test_a_missing_name_and_a_bad_hyperparameter_are_shown_in_one_submit(cast, alpha_setup):
    data = _run_form(alpha_setup, task_set_name="", hp_steps="-3")
    data["task_file"] = SimpleUploadedFile("rows.jsonl", ROWS)
    errors = client_for(cast.alice).post(new_run_url(alpha_setup), data).context["form"].errors
    assert errors["task_set_name"] == ["name the uploaded task set"] and errors["hp_steps"]


def test_the_form_preselects_what_the_projects_last_run_used(cast, alpha_setup):
    project = alpha_setup.project
    # Newer inputs the last run did not use: a reward sorted first, a newer task set and environment.
    other_reward = factories.RewardDefinitionFactory(project=project, name="aaa-first")
    factories.TaskSetFactory(project=project, name="newer")
    factories.EnvironmentFactory(project=project, name="newer-env")
    services.run_create(
        model=alpha_setup.model, task_set=alpha_setup.task_set, environment=alpha_setup.environment,
        reward=alpha_setup.reward, config={"steps": 2}, created_by=cast.alice,
    )  # fmt: skip
    form = client_for(cast.alice).get(new_run_url(alpha_setup)).context["form"]
    assert form["reward"].value() == alpha_setup.reward.pk != other_reward.pk
    assert form["task_set"].value() == alpha_setup.task_set.pk
    assert form["environment"].value() == alpha_setup.environment.pk
    assert f'<option value="{alpha_setup.reward.pk}" selected>' in str(form["reward"])
