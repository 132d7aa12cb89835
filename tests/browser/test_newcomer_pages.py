"""What a newcomer tripped on in the dashboard (issue 24), in Chromium against the web app alone
(uvicorn on the test database; no worker: nothing here needs a run to go): an uploaded JSONL file
starts the run on its own rows although another task set was preselected, the reward editor's dry
run works on its prefilled item, and a model's checkpoints page previews a prune (what goes, the
bytes freed, what is kept in use and why) before it deletes."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from artweb.demo import REWARD_SPEC
from projects import services
from projects.models import Checkpoint, Environment, Evaluation, Run, TaskRow, TaskSet
from tests import factories
from tests.browser.conftest import _start, _wait, _wait_for_other_connections_to_close
from tests.processes import Process, test_database_url
from tests.projects.gateway.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

NEW_ROWS = [
    {"prompt": "Say yes", "item": {"answer": "yes"}},
    {"prompt": "Say no", "item": {"answer": "no"}},
    {"prompt": "Say maybe", "item": {"answer": "maybe"}},
]


@pytest.fixture
def checkpoint_dir(settings, tmp_path) -> Path:
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    return settings.CHECKPOINT_DIR


@pytest.fixture
def web(transactional_db, checkpoint_dir, tmp_path) -> Iterator[Process]:
    """The web app under uvicorn, sharing the test's database and checkpoint folder."""
    data_dir = tmp_path / "data"
    env = {
        **os.environ,
        "DATABASE_URL": test_database_url(),
        "ARTWEB_DATA_DIR": str(data_dir),
        "ARTWEB_CHECKPOINT_DIR": str(checkpoint_dir),
        "DEBUG": "1",
        "HF_HUB_OFFLINE": "1",
    }
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "artweb.asgi:application", "--port", str(port)]
    process = _start("web", [*command, "--log-level", "warning"], env, tmp_path / "web.log")
    process.url = f"http://127.0.0.1:{port}"

    def ready(web: Process) -> bool:
        try:
            with urllib.request.urlopen(f"{web.url}/healthz", timeout=2):
                return True
        except OSError:
            return False

    try:
        _wait(process, ready)
        yield process
    finally:
        process.stop()
        _wait_for_other_connections_to_close()


@pytest.fixture
def alice(transactional_db, settings):
    from django.contrib.auth import get_user_model

    # The web process verifies the password with Django's default hashers, not the tests' MD5.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    user = get_user_model().objects.create_user("alice", password="pw-alice-123")
    team = services.team_create(name="alpha", owner=user)
    project = services.project_create(team=team, name="demo")
    base = factories.BaseModelFactory(name="tiny")
    model = services.trainable_model_create(project=project, name="agent", base_model=base)
    services.environment_create(project=project, name="chat", system_prompt="Answer with one word.")
    return type("Alice", (), {"user": user, "team": team, "project": project, "model": model})


def sign_in(page, url: str) -> None:
    page.goto(f"{url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/projects/")


# --- the new-run form: an uploaded file is what the run trains on ------------------------------


def test_an_uploaded_file_starts_the_run_on_its_own_rows(web, alice, browser):
    page, url = browser.page, web.url
    services.reward_definition_create(
        project=alice.project, name="has-a", spec={"type": "regex", "pattern": "a"}
    )
    old = factories.TaskSetFactory(project=alice.project, name="old-rows")
    sign_in(page, url)
    page.goto(f"{url}/projects/{alice.project.pk}/runs/new")
    # The newest task set is preselected, as the newcomer found it.
    assert page.input_value("#id_task_set") == str(old.pk)
    jsonl = "".join(json.dumps(row) + "\n" for row in NEW_ROWS)
    page.set_input_files(
        "#id_task_file",
        files=[{"name": "New Words.jsonl", "mimeType": "application/json", "buffer": jsonl.encode()}],
    )
    # Choosing a file switches the list to "upload" and names the new task set after the file.
    assert page.input_value("#id_task_set") == ""
    assert page.input_value("#id_task_set_name") == "new-words"
    browser.screenshot("newcomer-01-upload-chosen")
    page.click("text=Start run")
    page.wait_for_url(f"{url}/runs/*/")
    run = Run.objects.get()
    assert run.task_set.name == "new-words" and run.task_set != old
    rows = [row.data for row in TaskRow.objects.filter(task_set=run.task_set).order_by("index")]
    assert [row["item"] for row in rows] == [row["item"] for row in NEW_ROWS]
    message = page.locator(".messages").inner_text()
    assert "uploaded task set “new-words”" in message, message
    assert browser.console_errors == []


def test_with_the_script_off_the_file_still_wins_and_the_page_says_so(web, alice, browser):
    """Without the form's script the list stays on the old task set: the server uses the file and
    says that the selected task set was not used."""
    page, url = browser.page, web.url
    services.reward_definition_create(
        project=alice.project, name="has-a", spec={"type": "regex", "pattern": "a"}
    )
    old = factories.TaskSetFactory(project=alice.project, name="old-rows")
    sign_in(page, url)
    page.route("**/static/frontend/run_form*.js", lambda route: route.abort())
    page.goto(f"{url}/projects/{alice.project.pk}/runs/new")
    jsonl = "".join(json.dumps(row) + "\n" for row in NEW_ROWS)
    page.set_input_files(
        "#id_task_file", files=[{"name": "x.jsonl", "mimeType": "application/json", "buffer": jsonl.encode()}]
    )
    assert page.input_value("#id_task_set") == str(old.pk)  # no script: nothing switched
    page.fill("#id_task_set_name", "fresh")
    page.click("text=Start run")
    page.wait_for_url(f"{url}/runs/*/")
    run = Run.objects.get()
    assert run.task_set == TaskSet.objects.get(name="fresh")
    assert TaskRow.objects.filter(task_set=run.task_set).count() == len(NEW_ROWS)
    message = page.locator(".messages").inner_text()
    assert "uploaded task set “fresh”" in message and "“old-rows” was not used" in message, message


# --- the reward editor: its dry run works on the prefilled item --------------------------------


def test_the_reward_editors_dry_run_grades_its_prefilled_item(web, alice, browser):
    page, url = browser.page, web.url
    # The demo's reward reads item.accept; the project has the demo's kind of rows.
    reward = services.reward_definition_create(project=alice.project, name="correct", spec=REWARD_SPEC)
    rows = [{"prompt": "Capital of France?", "item": {"answer": "Paris", "accept": "Paris"}}]
    factories.TaskSetFactory(project=alice.project, name="capitals", rows=rows, validation_fraction=0.0)
    sign_in(page, url)
    page.goto(f"{url}/rewards/{reward.pk}/")
    assert json.loads(page.input_value("#try-item")) == rows[0]["item"]
    page.click("#try-it button[type=submit]")
    page.wait_for_selector("#try-result .reward-value")
    result = page.locator("#try-result").inner_text()
    browser.screenshot("newcomer-02-reward-dry-run")
    assert "not found" not in result and "No grader errors." in result, result
    # "The answer is Paris": an accepted answer in a sentence, correct but not exact.
    assert "Reward 0.500" in result, result
    assert browser.console_errors == []


# --- retention: preview a prune, then prune ----------------------------------------------------


def write_checkpoint(model, step: int, root: Path, size: int, **metrics) -> Checkpoint:
    folder = root / f"model-{model.pk}" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"a" * size)
    (folder / "adapter_config.json").write_text("{}")
    return services.checkpoint_record(model=model, run=None, step=step, path=str(folder), metrics=metrics)


def test_retention_previews_a_prune_then_frees_the_disk(web, alice, checkpoint_dir, browser):
    page, url = browser.page, web.url
    model = alice.model
    rewards = {0: 0.1, 1: 0.9, 2: 0.2, 3: 0.3, 4: 0.4}
    checkpoints = {
        step: write_checkpoint(model, step, checkpoint_dir, size=100_000 * (step + 1), reward_mean=reward)
        for step, reward in rewards.items()
    }
    # A queued evaluation reads step 2: the prune must keep it and say why.
    task_set = factories.TaskSetFactory(project=alice.project, name="rows")
    reward = services.reward_definition_create(
        project=alice.project, name="has-a", spec={"type": "regex", "pattern": "a"}
    )
    evaluation = Evaluation.objects.create(
        project=alice.project, checkpoint=checkpoints[2], task_set=task_set,
        environment=Environment.objects.get(project=alice.project), reward=reward, status="queued",
    )  # fmt: skip
    step_0_bytes = sum(f.stat().st_size for f in Path(checkpoints[0].path).iterdir())
    sign_in(page, url)
    page.goto(f"{url}/models/{model.pk}/")
    page.click("text=Checkpoints and retention")
    page.wait_for_url(f"{url}/models/{model.pk}/checkpoints")
    assert "the model's latest checkpoint" in page.locator("table.checkpoints").inner_text()
    # Keep the last 2 and the best 1 by reward_mean (step 1): steps 0 and 2 would go, 2 is in use.
    page.fill("#id_keep_last", "2")
    page.fill("#id_keep_best_metric", "reward_mean")
    page.fill("#id_keep_best_n", "1")
    page.select_option("#id_keep_best_mode", "max")
    page.click("button[name=action][value=preview]")
    preview = page.locator("#prune-preview")
    preview.wait_for()
    browser.screenshot("newcomer-03-prune-preview")
    doomed = preview.locator("[data-step]").evaluate_all("items => items.map(item => item.dataset.step)")
    assert doomed == ["0"]
    assert int(preview.get_attribute("data-freed-bytes")) == step_0_bytes
    in_use = preview.locator(".in-use").inner_text()
    assert "step 2" in in_use and f"evaluation {evaluation.pk} (queued) reads it" in in_use, in_use
    assert sorted(Checkpoint.objects.filter(model=model).values_list("step", flat=True)) == [0, 1, 2, 3, 4]

    page.click("button[name=action][value=prune]")
    page.wait_for_selector(".messages")
    message = page.locator(".messages").inner_text()
    browser.screenshot("newcomer-04-pruned")
    assert sorted(Checkpoint.objects.filter(model=model).values_list("step", flat=True)) == [1, 2, 3, 4]
    assert "Deleted step 0" in message and "Kept step 2: evaluation" in message, message
    # The files are gone from the store once the delete committed.
    left = sorted(p.name for p in (checkpoint_dir / f"model-{model.pk}").iterdir())
    assert left == ["step-000001", "step-000002", "step-000003", "step-000004"]
    assert browser.console_errors == []
