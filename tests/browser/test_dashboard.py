"""One person's path through the dashboard in Chromium, on the real stack (see conftest): sign in,
create and revoke an API key, start a run from the form with an uploaded JSONL task set, watch it
succeed on the run page with the charts drawn, open a trajectory, dry-run a grader, and chat with
the checkpoint beside its base model, evaluate the checkpoint against its base model from its page
and watch the queued evaluation finish. No page may log a console error."""

from __future__ import annotations

import json
import re
from unittest import mock

import pytest

from projects import services
from projects.models import ApiKey, BaseModel, EnvironmentKind, Evaluation, Membership, Run, RunStatus
from projects.services import judges
from tests.browser.conftest import chat_in_playground
from tests.openai_stub import openai_stub

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# Four training rows and two explicit validation rows: the run evaluates its step-0 and final
# checkpoints on those two (training/runs/evaluation.py), a few greedy answers on the tiny model.
GOOD_ROWS = (
    "\n".join(
        [json.dumps({"prompt": f"Say {w}", "item": {"answer": w}}) for w in "abcd"]
        + [json.dumps({"prompt": f"Say {w}", "item": {"answer": w}, "split": "validation"}) for w in "ea"]
    )
    + "\n"
)
NUMBER = re.compile(r"^-?\d+\.\d{3}$")
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
    dora = get_user_model().objects.create_user("dora", password="pw-dora-123")
    # Joining needs consent: alice invites, dora accepts.
    invitation = services.invitation_create(team=team, invitee="dora", role="member", by=alice)
    services.invitation_accept(token=invitation.token, user=dora)
    project = services.project_create(team=team, name="demo", description="The dashboard's browser test")
    services.trainable_model_create(
        project=project, name="agent", base_model=BaseModel.objects.get(name="tiny")
    )
    services.environment_create(project=project, name="chat", system_prompt="Answer with one word.")
    services.reward_definition_create(project=project, name="has-a", spec={"type": "regex", "pattern": "a"})
    return project


def test_dashboard_from_sign_in_to_playground(stack, workspace, browser, tmp_path):
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
    assert (run.task_set.train_count, run.task_set.validation_count) == (4, 2)

    # The run page updates itself (htmx polling) until the run succeeds; the charts are drawn.
    page.wait_for_selector("#run-live-inner[data-status=succeeded]", timeout=240_000)
    assert Run.objects.get().status == RunStatus.SUCCEEDED
    page.wait_for_function(
        "() => window.Chart && Chart.getChart('chart-reward') && Chart.getChart('chart-reward').data.labels.length === 2"
    )
    for chart in ("chart-reward", "chart-loss", "chart-tokens_per_second"):
        assert page.evaluate(CANVAS_HAS_INK, chart) > 100, chart
    assert page.locator(".progress").get_attribute("aria-valuenow") == "2"
    # The run evaluated its step-0 and final checkpoints on the validation rows; the table is
    # rendered with the page, so load it again now that the run is over.
    page.reload()
    page.wait_for_function("() => window.Chart && Chart.getChart('chart-reward')")
    evaluations = page.locator("table.evaluations tbody tr")
    assert evaluations.count() == 2
    assert page.locator("table.evaluations td.step").all_inner_texts() == ["0", "2"]
    for row in range(2):
        cells = evaluations.nth(row)
        assert cells.locator("td.samples").inner_text() == "2"
        assert NUMBER.match(cells.locator("td.reward-mean").inner_text()), cells.inner_text()
        assert NUMBER.match(cells.locator("td.pass-rate .rate").inner_text()), cells.inner_text()
    assert re.match(r"^\d\.\d{3} vs step 0$", evaluations.nth(1).locator("td.win-rate").inner_text())
    # Charts that tell the truth: validation reward per evaluated step, grad norm and completion
    # length drawn; KL with kl_coef 0 not drawn at all but labelled; smoothing redraws.
    page.wait_for_function(
        "() => Chart.getChart('chart-validation') && Chart.getChart('chart-validation').data.datasets[0].data.length === 2"
    )
    for chart in ("chart-validation", "chart-grad_norm", "chart-completion_tokens", "chart-sub_rewards"):
        assert page.evaluate(CANVAS_HAS_INK, chart) > 100, chart
    assert page.locator("#chart-kl").is_hidden()
    assert page.locator("#note-kl").inner_text().startswith("Not measured: kl_coef is 0")
    # The default recipe takes two minibatches a step: the clip fraction's note says what it measures.
    assert "2 optimizer steps per batch" in page.locator("#note-clip_fraction").inner_text()
    page.select_option("#chart-smoothing", "0.8")
    page.wait_for_function(
        "() => Chart.getChart('chart-reward').data.datasets.some(d => d.label.includes('EMA 0.8'))"
    )
    page.select_option("#chart-smoothing", "0")
    browser.screenshot("07-run-succeeded")

    # Trajectory viewer: the group side by side, best first.
    page.click("text=Trajectories")
    page.wait_for_selector(".trajectory")
    assert page.locator(".trajectory").count() == 2
    rewards = [float(t.split()[1]) for t in page.locator(".trajectory header strong").all_inner_texts()]
    assert rewards == sorted(rewards, reverse=True)
    assert page.locator(".trajectory .msg.role-assistant").count() == 2
    assert page.locator(".trajectory .advantage").count() == 2
    assert page.locator(".reference-item pre").inner_text().strip().startswith("{")  # the row's item
    browser.screenshot("08-trajectories")
    # Keyboard: "[" goes to the previous step (the viewer opens on the last one); the filter
    # "groups with variance only" applies as soon as it is ticked.
    assert "step 2" in page.locator(".trajectory-nav .position").inner_text()
    page.keyboard.press("[")
    page.wait_for_url(re.compile(r".*step=1.*"))
    assert "step 1" in page.locator(".trajectory-nav .position").inner_text()
    page.click("input[name=variance]")  # the form submits on change
    page.wait_for_url(re.compile(r".*variance=1.*"))
    assert page.locator(".trajectory .zero-variance, .badge.zero-variance").count() == 0

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
    # The run's final evaluation is this checkpoint's.
    assert page.locator("table.evaluations tbody tr").count() == 1
    assert NUMBER.match(page.locator("table.evaluations td.reward-mean").inner_text())
    assert page.locator("table.evaluations td.samples").inner_text() == "2"
    # The playground starts from what the checkpoint was trained and evaluated with: the run's
    # environment's system prompt and its evaluation temperature, and says so.
    assert page.locator("#pg-system").input_value() == "Answer with one word."
    assert float(page.locator("#pg-temperature").input_value()) == run.config.get("eval_temperature", 0.0)
    assert f"run #{run.pk}" in page.locator("#pg-defaults").inner_text()
    answers = chat_in_playground(page, "Say a", max_tokens=12)
    assert answers["checkpoint"] or answers["base"]
    browser.screenshot("10-checkpoint-playground")

    # Evaluate the checkpoint against its base model from the checkpoint page (the form is
    # prefilled with the run's task set, environment and reward): the worker runs the queued job
    # while the evaluation page polls; then results and the samples side by side.
    page.click("summary:has-text('Evaluate this checkpoint')")
    page.select_option("#id_reference", value=f"base:{BaseModel.objects.get(name='tiny').pk}")
    page.click("summary:has-text('Sampling and pass threshold')")
    page.fill("#id_max_new_tokens", "6")
    page.click("text=Queue evaluation")
    page.wait_for_url(f"{url}/evaluations/*/")
    page.wait_for_selector("#evaluation-live[data-status=succeeded]", timeout=120_000)
    evaluation = Evaluation.objects.get(run=None)
    assert evaluation.checkpoint.step == 2 and evaluation.reference_base_model is not None
    for side in ("subject", "reference"):
        cell = page.locator(f".results-table tr[data-metric=reward_mean] td.{side}")
        assert NUMBER.match(cell.inner_text()), cell.inner_text()
    assert NUMBER.match(page.locator(".comparison .win-rate").inner_text())
    assert page.locator(".sample-row").count() == 2
    assert page.locator(".sample-row").first.locator(".trajectory").count() == 2
    assert page.locator(".sample-row .trajectory.side-reference .msg.role-assistant").count() == 2
    browser.screenshot("19-evaluation")
    page.goto(f"{url}/evaluations/")
    assert page.locator("table.evaluations tbody tr").count() == 3  # the run's two and this one
    page.goto(f"{url}/projects/{workspace.pk}/task-sets/generate")
    assert page.locator("#endpoint-needed").count() == 1  # no team endpoint: how to add one
    assert page.locator("button:has-text('Generate task set')").is_disabled()
    browser.screenshot("20-generate-needs-endpoint")
    # With a team endpoint (a scripted OpenAI-compatible stub on loopback, tests/openai_stub.py)
    # a worker generates the rows (a ScenarioJob on the default queue) while the job's page polls
    # its progress; when the task set is made the page moves on to it, which shows the report.
    reply = "\n".join(
        [
            '{"prompt": "Say maybe", "item": ',  # malformed
            json.dumps({"prompt": "Say yes", "item": {"answer": "yes"}}),
            json.dumps({"prompt": "say YES", "item": {"answer": "yes"}}),  # a duplicate
            json.dumps({"prompt": "Say no", "item": {"answer": "no"}}),
        ]
    )
    with openai_stub([reply]) as stub:
        judges.judge_endpoint_create(
            team=workspace.team, name="writer", base_url=stub.url, default_model="writer-model"
        )
        page.goto(f"{url}/projects/{workspace.pk}/")
        page.click("text=Generate scenarios")
        page.fill("#id_n", "2")
        page.fill("#id_instruction", "one-word answers")
        page.fill("#id_name", "generated")
        page.click("button:has-text('Generate task set')")
        page.wait_for_url(f"{url}/scenario-jobs/*/")
        assert page.locator("#scenario-job-live .rows-progress").inner_text().endswith("/ 2 rows accepted")
        page.wait_for_url(f"{url}/task-sets/*/", timeout=90_000)
    assert page.locator(".generation-report dd.accepted").inner_text() == "2"
    assert page.locator(".generation-report dd.rejected").inner_text() == "2"
    assert page.locator("table.row-errors tbody tr").count() == 2
    browser.screenshot("21-generated-task-set")

    # Lists, members and the environment form (every kind offered; unavailable ones disabled).
    page.goto(f"{url}/runs/?status=succeeded")
    assert page.locator("tbody tr").count() == 1
    browser.screenshot("11-runs-list")
    page.goto(f"{url}/team/members")
    assert page.locator("tr[data-member=dora]").count() == 1
    browser.screenshot("12-members")
    page.fill("#id_invitee", "erin@example.com")
    page.click("button:has-text('Invite')")
    page.wait_for_selector("#accept-link")
    assert "/invitations/accept?token=inv_" in page.locator("#accept-link").inner_text()
    browser.screenshot("12-members-invited")
    page.click("tr[data-invitation='erin@example.com'] >> text=Revoke")  # the dialog is accepted
    page.wait_for_selector("text=The invitation for erin@example.com was revoked.")
    page.click("tr[data-member=dora] >> text=Remove")  # the confirmation dialog is accepted
    page.wait_for_selector("text=dora was removed from the team.")
    assert page.locator("tr[data-member=dora]").count() == 0
    assert not Membership.objects.filter(user__username="dora").exists()
    page.click("tr[data-member=alice] >> text=Leave")  # the last owner: refused, with the reason
    page.wait_for_selector(".messages .error")
    assert "last owner" in page.locator(".messages .error").inner_text()
    browser.screenshot("12-members-removed")
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

    # Compare runs: tick two runs on the runs list, "Compare"; one chart per metric with a line
    # per run, and the config diff marks the hyperparameter they differ in.
    other = _record_compare_run(run, tmp_path)
    page.goto(f"{url}/runs/")
    page.check(f"input[name=ids][value='{run.pk}']")
    page.check(f"input[name=ids][value='{other.pk}']")
    page.click("#compare-form button:has-text('Compare')")
    page.wait_for_url(f"{url}/runs/compare?*")
    page.wait_for_function(
        "() => window.Chart && Chart.getChart('chart-reward') && Chart.getChart('chart-loss')"
    )
    assert page.evaluate("Chart.getChart('chart-reward').data.datasets.length") == 2
    for chart in ("chart-reward", "chart-loss", "chart-validation"):
        assert page.evaluate(CANVAS_HAS_INK, chart) > 100, chart
    differing = page.locator("table.config-diff tr.differs").evaluate_all(
        "rows => rows.map(r => r.dataset.key)"
    )
    assert "learning_rate" in differing and "group_size" not in differing, differing
    browser.screenshot("13-compare-runs")

    # A long run whose reward no reply can reach: the run page says what the worker is doing now
    # (its phase, with the time it began) and, after one step without a learning signal, shows the
    # warning banner linking to the viewer. Then cancel it from its page (the dialog is accepted).
    never = services.reward_definition_create(
        project=workspace, name="never", spec={"type": "regex", "pattern": "^NEVER MATCHES$"}
    )
    long_run = services.run_create(
        model=run.model, task_set=run.task_set, environment=run.environment, reward=never,
        config={"steps": 500, "group_size": 2, "max_new_tokens": 6, "no_signal_patience": 1},
    )  # fmt: skip
    page.goto(f"{url}/runs/{long_run.pk}/")
    page.wait_for_selector("#run-live-inner[data-status=running]", timeout=60_000)
    page.wait_for_selector("#run-live-inner .phase", timeout=60_000)
    phase = page.locator("#run-live-inner .phase")
    assert phase.get_attribute("data-phase") in {
        "loading",
        "evaluating",
        "rollouts",
        "grading",
        "updating",
        "saving",
    }
    assert phase.inner_text().startswith("Now: ") and "(since " in phase.inner_text()
    page.wait_for_selector(".notice.no-signal", timeout=120_000)
    banner = page.locator(".notice.no-signal").first
    assert "no learning signal" in banner.inner_text()
    assert banner.locator("a").get_attribute("href") == f"/runs/{long_run.pk}/trajectories"
    browser.screenshot("14-run-no-signal")
    page.click("text=Cancel run")
    page.wait_for_selector("#run-live-inner[data-status=cancelled]", timeout=60_000)
    assert Run.objects.get(pk=long_run.pk).status == RunStatus.CANCELLED
    browser.screenshot("14-run-cancelled")

    # A multi-turn tool transcript in the trajectory viewer: calls, results, where they diverge.
    tool_run = _record_tool_run(workspace, tmp_path)
    page.goto(f"{url}/runs/{tool_run.pk}/trajectories")
    page.wait_for_selector(".trajectory")
    columns = page.locator(".trajectory")
    assert columns.count() == 2
    best, worst = columns.nth(0), columns.nth(1)
    assert best.locator("header strong").inner_text() == "Reward 1.000"
    assert best.locator(".msg.role-assistant").count() == 3 and best.locator(".msg.role-tool").count() == 2
    assert best.locator(".tool-call .tool-name").all_inner_texts() == ["→ calculator", "→ calculator"]
    assert best.locator(".msg.role-tool .content").all_inner_texts() == ["42", "50"]
    assert "(result of call_1_0)" in (best.locator(".msg.role-tool .role").nth(1).text_content() or "")
    assert "not an arithmetic expression" in worst.locator(".msg.role-tool .content").nth(1).inner_text()
    assert best.locator(".msg.divergence").count() == 1 and worst.locator(".msg.divergence").count() == 1
    # The viewer explains the rewards: the row's reference item, the group's mean/std and each
    # sample's group-relative advantage (scaled by the std, as the run's config says); it fits the
    # page at 1280 px (the group scrolls inside its panel).
    assert page.locator(".reference-item pre").inner_text().strip() == "{}"
    assert (
        page.locator(".group-mean").inner_text() == "0.5" and page.locator(".group-std").inner_text() == "0.5"
    )
    assert best.locator(".advantage").inner_text() == "advantage +1"
    assert worst.locator(".advantage").inner_text() == "advantage -1"
    assert page.locator(".badge.zero-variance").count() == 0
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    browser.screenshot("18-trajectory-tools")

    # The same pages on a phone.
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{url}/runs/{run.pk}/")
    page.wait_for_function("() => window.Chart && Chart.getChart('chart-reward')")
    browser.screenshot("15-phone-run")
    page.goto(f"{url}/runs/{run.pk}/trajectories")
    browser.screenshot("16-phone-trajectories")
    page.goto(f"{url}/runs/{tool_run.pk}/trajectories")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # columns scroll in their panel
    browser.screenshot("16-phone-trajectory-tools")
    page.goto(f"{url}/projects/{workspace.pk}/runs/new")
    browser.screenshot("17-phone-new-run")
    page.goto(f"{url}/evaluations/{evaluation.pk}/")
    browser.screenshot("19-phone-evaluation")

    page.click("text=Sign out")
    page.wait_for_url(f"{url}/login/")

    assert browser.console_errors == [], browser.console_errors


TOOL_PROMPT = "What is 6*7+8? Use the calculator."


def _record_compare_run(run: Run, tmp_path) -> Run:
    """A second finished run to compare with ``run``: its inputs, another learning rate, on its
    own model (so ``run``'s model starts from its real checkpoint later); two steps and a
    validation evaluation recorded through the services a worker uses, not trained."""
    model = services.trainable_model_create(
        project=run.project, name="compare-agent", base_model=run.model.base_model
    )
    config = {
        "steps": 2,
        "group_size": 2,
        "max_new_tokens": 6,
        "learning_rate": run.config["learning_rate"] * 2,
    }
    with mock.patch.object(services.runs, "_enqueue_run", lambda run_id: None):  # recorded here, not trained
        other = services.run_create(
            model=model, task_set=run.task_set, environment=run.environment, reward=run.reward, config=config
        )
    claimed = services.run_claim(run_id=other.pk, worker="browser-test")
    assert claimed is not None
    for step, reward in ((1, 0.25), (2, 0.75)):
        path = tmp_path / f"compare-agent-step-{step}"
        path.mkdir()
        assert services.step_record(
            run=claimed, worker="browser-test", step=step, trajectories=[], checkpoint_path=str(path),
            metrics={"reward_mean": reward, "reward_std": 0.25, "loss": 0.1 * step, "trainable_tokens": 8},
        )  # fmt: skip
    Evaluation.objects.create(
        project=run.project, run=other, step=2, task_set=run.task_set, environment=run.environment,
        reward=run.reward, status="succeeded", results={"n": 2, "reward_mean": 0.5},
    )  # fmt: skip
    return services.run_transition(run_id=other.pk, to=RunStatus.SUCCEEDED, message="Run succeeded")


def _calculator(expression: str) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def _record_tool_run(project, tmp_path) -> Run:
    """A run on a ``python_tools`` environment with one step of two multi-turn trajectories,
    recorded through the services a worker uses (claim, step_record, transition). The tiny random
    model never writes a tool call, so the model's turns are scripted; everything else is real: the
    environment runs the calculator, ``parse_tool_calls`` reads the calls, the grader grades."""
    from training.rewards import Sample, grade
    from training.rollouts.tools import parse_tool_calls

    environment = services.environment_create(
        project=project,
        name="calculator",
        kind=EnvironmentKind.PYTHON_TOOLS,
        tools=["calculator"],
        max_turns=4,
    )
    reward = services.reward_definition_create(
        project=project,
        name="says-50",
        spec={
            "type": "string_check",
            "input": "{{sample.output_text}}",
            "reference": "50",
            "operation": "like",
        },
    )
    task_set = services.task_set_create(
        project=project, name="arithmetic", jsonl=json.dumps({"prompt": TOOL_PROMPT, "item": {}}) + "\n"
    )
    model = services.trainable_model_create(
        project=project, name="tool-agent", base_model=BaseModel.objects.get(name="tiny")
    )
    with mock.patch.object(services.runs, "_enqueue_run", lambda run_id: None):  # recorded here, not trained
        run = services.run_create(
            model=model, task_set=task_set, environment=environment, reward=reward,
            config={"steps": 1, "group_size": 2},
        )  # fmt: skip
    worker = "browser-test"
    claimed = services.run_claim(run_id=run.pk, worker=worker)
    assert claimed is not None
    scripts = [
        [_calculator("6*7"), _calculator("42+8"), "The answer is 50."],
        [_calculator("6*7"), _calculator("42+"), "The answer is 48."],
    ]
    records = []
    core = services.environment_build(environment=environment)
    for sample_index, turns in enumerate(scripts):
        state = core.start({"prompt": TOOL_PROMPT, "item": {}}, seed=sample_index)
        messages = list(state.messages)
        for turn, text in enumerate(turns):
            calls = parse_tool_calls(text, id_prefix=f"call_{turn}_")
            message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            messages.append(message)
            reply = core.respond(state, text, calls)
            messages += reply.messages
            if reply.done:
                break
        graded = grade(reward.spec, Sample(output_text=turns[-1], messages=messages), {})
        records.append(
            services.TrajectoryRecord(
                group_index=0, sample_index=sample_index, task_row_index=0, messages=messages,
                reward=graded.reward, sub_rewards=graded.sub_rewards, errors=graded.errors,
                metrics={"turns": len(turns), "tool_calls": 2}, prompt_tokens=30, completion_tokens=40,
                finish_reason="stop",
            )
        )  # fmt: skip
    core.close()
    rewards = [record.reward for record in records]
    assert rewards == [1.0, 0.0], rewards
    checkpoint = tmp_path / "tool-agent-step-1"
    checkpoint.mkdir()
    assert services.step_record(
        run=claimed, worker=worker, step=1, metrics={"reward_mean": 0.5, "reward_std": 0.5, "loss": 0.0},
        trajectories=records, checkpoint_path=str(checkpoint),
    )  # fmt: skip
    return services.run_transition(run_id=run.pk, to=RunStatus.SUCCEEDED, message="Run succeeded")
