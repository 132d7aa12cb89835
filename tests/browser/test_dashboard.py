"""One person's path through the dashboard in Chromium, on the real stack (see conftest): sign in,
create and revoke an API key, start a run from the form with an uploaded JSONL task set, watch it
succeed on the run page with the charts drawn, open a trajectory, dry-run a grader, and chat with
the checkpoint beside its base model. No page may log a console error."""

from __future__ import annotations

import json

import pytest

from projects import services
from projects.models import ApiKey, EnvironmentKind, Run, RunStatus

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

GOOD_ROWS = "\n".join(json.dumps({"prompt": f"Say {w}", "item": {"answer": w}}) for w in "abcd") + "\n"
BAD_ROWS = '{"prompt": "fine", "item": {}}\n{not json}\n{"item": {"answer": "x"}}\n'

# A canvas has been drawn on when some pixel is not fully transparent.
CANVAS_HAS_INK = """(id) => {
  const canvas = document.getElementById(id);
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  let ink = 0;
  for (let i = 3; i < data.length; i += 4) if (data[i] !== 0) ink++;
  return ink;
}"""


@pytest.fixture
def workspace(transactional_db, settings):
    from django.contrib.auth import get_user_model

    # The web process verifies the password with Django's default hashers, not the tests' MD5.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    alice = get_user_model().objects.create_user("alice", password="pw-alice-123")
    team = services.team_create(name="alpha", owner=alice)
    project = services.project_create(team=team, name="demo", description="The dashboard's browser test")
    from projects.models import BaseModel

    services.trainable_model_create(
        project=project, name="agent", base_model=BaseModel.objects.get(name="tiny")
    )
    services.environment_create(project=project, name="chat", system_prompt="Answer with one word.")
    services.reward_definition_create(project=project, name="has-a", spec={"type": "regex", "pattern": "a"})
    return project


def test_dashboard_from_sign_in_to_playground(stack, workspace, browser):
    page, url = browser.page, stack.web.url

    # Sign in.
    page.goto(f"{url}/projects/")
    assert "/login/" in page.url
    browser.screenshot("01-login")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "pw-alice-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/projects/")
    assert page.locator("text=demo").count() >= 1
    browser.screenshot("02-projects")
    # Keyboard: the first Tab reaches the skip link, which moves focus past the header.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    page.keyboard.press("Enter")
    assert page.url.endswith("#main")

    # API keys: create (shown once), revoke.
    page.click("nav >> text=API keys")
    page.fill("#id_name", "ci")
    page.click("text=Create key")
    plaintext = page.locator("#new-key").inner_text()
    assert plaintext.startswith("aw_")
    browser.screenshot("03-api-key-created")
    page.click("text=Revoke")  # the confirmation dialog is accepted
    page.wait_for_selector("text=revoked")
    assert ApiKey.objects.get(name="ci").revoked_at is not None
    browser.screenshot("04-api-key-revoked")

    # Project page, then the New run form: a bad upload shows its line errors next to the field.
    page.goto(f"{url}/projects/{workspace.pk}/")
    browser.screenshot("05-project")
    page.click("text=New run")
    page.set_input_files(
        "#id_task_file",
        files=[{"name": "bad.jsonl", "mimeType": "application/json", "buffer": BAD_ROWS.encode()}],
    )
    page.fill("#id_task_set_name", "words")
    page.click("text=Start run")
    errors = page.locator(".field.invalid .field-errors").all_inner_texts()
    assert any("line 2" in e and "invalid JSON" in e for e in errors), errors
    assert any("line 3" in e for e in errors), errors
    browser.screenshot("06-new-run-errors")
    page.set_input_files(
        "#id_task_file",
        files=[{"name": "words.jsonl", "mimeType": "application/json", "buffer": GOOD_ROWS.encode()}],
    )
    page.fill("#id_hp_steps", "2")
    page.fill("#id_hp_group_size", "2")
    page.fill("#id_hp_max_new_tokens", "6")
    page.click("text=Start run")
    page.wait_for_url(f"{url}/runs/*/")
    run = Run.objects.get()
    assert run.total_steps == 2 and run.config["group_size"] == 2

    # The run page updates itself (htmx polling) until the run succeeds; the charts are drawn.
    page.wait_for_selector("#run-live-inner[data-status=succeeded]", timeout=240_000)
    assert Run.objects.get().status == RunStatus.SUCCEEDED
    page.wait_for_function(
        "() => window.Chart && Chart.getChart('chart-reward') && Chart.getChart('chart-reward').data.labels.length === 2"
    )
    for chart in ("chart-reward", "chart-loss", "chart-tokens_per_second"):
        assert page.evaluate(CANVAS_HAS_INK, chart) > 100, chart
    assert page.locator(".progress").get_attribute("aria-valuenow") == "2"
    browser.screenshot("07-run-succeeded")

    # Trajectory viewer: the group side by side, best first.
    page.click("text=Trajectories")
    page.wait_for_selector(".trajectory")
    assert page.locator(".trajectory").count() == 2
    rewards = [float(t.split()[1]) for t in page.locator(".trajectory header strong").all_inner_texts()]
    assert rewards == sorted(rewards, reverse=True)
    assert page.locator(".trajectory .msg.role-assistant").count() == 2
    browser.screenshot("08-trajectories")

    # Reward editor: validation as you type, and a dry run through the graders endpoint.
    page.goto(f"{url}/projects/{workspace.pk}/rewards/")
    page.click("text=has-a")
    page.wait_for_selector(".validation.valid")  # the saved spec, validated on load
    page.fill("#id_spec", '{"type": "regex"}')
    page.wait_for_selector(".validation.invalid")
    page.fill("#id_spec", '{"type": "regex", "pattern": "ban"}')
    page.wait_for_selector(".validation.valid")
    page.fill("#try-sample", "banana")
    page.fill("#try-item", "{}")
    page.click("#try-it button[type=submit]")
    page.wait_for_selector(".reward-value")
    assert page.locator(".reward-value").inner_text() == "Reward 1.000"
    browser.screenshot("09-reward-editor")
    page.fill("#id_spec", '{"type": "regex"}')  # a spec with problems is reported, not sent
    page.click("#try-it button[type=submit]")
    page.wait_for_selector("#try-result .error")
    assert "Fix the spec first" in page.locator("#try-result").inner_text()

    # Checkpoint page: the playground streams from the checkpoint and its base model.
    page.goto(f"{url}/runs/{run.pk}/")
    page.get_by_role("link", name="step 2", exact=True).click()
    page.wait_for_selector("#playground")
    assert "demo/agent:2" in page.locator("#snippet-python").inner_text()
    page.fill("#pg-prompt", "Say a")
    page.fill("#pg-max-tokens", "12")
    page.click("#playground-form button[type=submit]")
    page.wait_for_selector("#pg-answer-checkpoint[data-done]", timeout=60_000)
    page.wait_for_selector("#pg-answer-base[data-done]", timeout=60_000)
    for answer in ("#pg-answer-checkpoint", "#pg-answer-base"):
        assert "error" not in (page.locator(answer).get_attribute("class") or ""), page.locator(
            answer
        ).inner_text()
    assert page.locator("#pg-answer-checkpoint").inner_text() or page.locator("#pg-answer-base").inner_text()
    browser.screenshot("10-checkpoint-playground")

    # Lists, members and the environment form (every kind offered; unavailable ones disabled).
    page.goto(f"{url}/runs/?status=succeeded")
    assert page.locator("tbody tr").count() == 1
    browser.screenshot("11-runs-list")
    page.goto(f"{url}/team/members")
    browser.screenshot("12-members")
    page.goto(f"{url}/models/{run.model_id}/")
    assert page.get_by_role("link", name="step 2", exact=True).count() == 1
    browser.screenshot("12-model")
    page.goto(f"{url}/projects/{workspace.pk}/rewards/")
    page.click("summary:has-text('New reward definition')")
    page.wait_for_selector(".validation.valid")  # the example spec, validated on load
    browser.screenshot("12-reward-definitions")
    page.goto(f"{url}/projects/{workspace.pk}/")
    page.click("summary:has-text('New environment')")
    assert page.locator("#id_environment-kind option").count() == len(EnvironmentKind.values)
    browser.screenshot("13-project-new-environment")

    # Cancel a long run from its page (the confirmation dialog is accepted).
    long_run = services.run_create(
        model=run.model, task_set=run.task_set, environment=run.environment, reward=run.reward,
        config={"steps": 500, "group_size": 2, "max_new_tokens": 6},
    )  # fmt: skip
    page.goto(f"{url}/runs/{long_run.pk}/")
    page.wait_for_selector("#run-live-inner[data-status=running]", timeout=60_000)
    page.click("text=Cancel run")
    page.wait_for_selector("#run-live-inner[data-status=cancelled]", timeout=60_000)
    assert Run.objects.get(pk=long_run.pk).status == RunStatus.CANCELLED
    browser.screenshot("14-run-cancelled")

    # The same pages on a phone.
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{url}/runs/{run.pk}/")
    page.wait_for_function("() => window.Chart && Chart.getChart('chart-reward')")
    browser.screenshot("15-phone-run")
    page.goto(f"{url}/runs/{run.pk}/trajectories")
    browser.screenshot("16-phone-trajectories")
    page.goto(f"{url}/projects/{workspace.pk}/runs/new")
    browser.screenshot("17-phone-new-run")

    page.click("text=Sign out")
    page.wait_for_url(f"{url}/login/")

    assert browser.console_errors == [], browser.console_errors
