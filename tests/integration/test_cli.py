"""The ``artweb`` command line as a CI job uses it, against the real stack (web under uvicorn,
a Celery worker, the inference server; tests/browser/conftest.py): log in, start a run and wait for
it, evaluate with a pass threshold, download the adapter. Exit codes are what pipelines branch on."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from projects import services
from projects.models import BaseModel, Checkpoint, Run, RunStatus
from tests.browser.conftest import stack  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ROWS = "".join(json.dumps({"prompt": f"Say {w}", "item": {"answer": w}}) + "\n" for w in "abcd")


def artweb(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "artweb.cli", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture
def team_setup(transactional_db):
    from django.contrib.auth import get_user_model

    owner = get_user_model().objects.create_user("ci-owner")
    team = services.team_create(name="ci", owner=owner)
    project = services.project_create(team=team, name="cli")
    model = services.trainable_model_create(
        project=project, name="agent", base_model=BaseModel.objects.get(name="tiny")
    )
    return {
        "team": team,
        "model": model.pk,
        "task_set": services.task_set_create(
            project=project, name="words", jsonl=ROWS, validation_fraction=0.5
        ).pk,
        "environment": services.environment_create(
            project=project, name="chat", system_prompt="One word."
        ).pk,
        "reward": services.reward_definition_create(
            project=project, name="has-a", spec={"type": "regex", "pattern": "a"}
        ).pk,
        "key": services.api_key_create(team=team, name="ci").plaintext,
    }


def test_a_ci_job_trains_evaluates_and_downloads_with_exit_codes(stack, team_setup, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARTWEB_")}
    env["ARTWEB_CONFIG"] = str(tmp_path / "credentials.json")

    # No key yet: exit 3 with the way out.
    refused = artweb("runs", "watch", "1", env=env)
    assert refused.returncode == 3 and "ARTWEB_API_KEY" in refused.stderr
    wrong = artweb("login", "--base-url", stack.web.url, "--api-key", "aw_wrong_key", env=env)
    assert wrong.returncode == 3 and "HTTP 401" in wrong.stderr, wrong.stderr
    login = artweb("login", "--base-url", stack.web.url, "--api-key", team_setup["key"], env=env)
    assert login.returncode == 0, login.stderr
    saved = Path(env["ARTWEB_CONFIG"])
    assert json.loads(saved.read_text())["base_url"] == stack.web.url
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600  # a secret: only its owner reads it

    # Input the API refuses: exit 2 with the field and the reason.
    body = {key: team_setup[key] for key in ("model", "task_set", "environment", "reward")}
    bad = artweb("runs", "create", "-f", "-", env=env, stdin=json.dumps({**body, "config": {"lr": 1}}))
    assert bad.returncode == 2 and "HTTP 400" in bad.stderr and "learning_rate" in bad.stderr, bad.stderr
    not_json = artweb("runs", "create", "-f", "-", env=env, stdin="{not json")
    assert not_json.returncode == 2 and "not valid JSON" in not_json.stderr

    # A run followed to its end: exit 0, the per-step bar and the outcome line.
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({**body, "config": {"steps": 2, "group_size": 2, "max_new_tokens": 4}}))
    created = artweb("runs", "create", "-f", str(run_file), "--wait", "--interval", "0.5", env=env)
    assert created.returncode == 0, created.stdout + created.stderr
    run = Run.objects.get()
    assert run.status == RunStatus.SUCCEEDED
    assert f"Run {run.pk} succeeded after 2/2 steps" in created.stdout
    assert "reward=" in created.stderr and "loss=" in created.stderr  # the bar's postfix
    assert "rollouts" in created.stdout  # phase lines, timestamped

    # An evaluation of the last checkpoint with a threshold it cannot meet: exit 1; a reachable
    # one: exit 0. (--fail-below without --wait is a usage error.)
    checkpoint = Checkpoint.objects.get(model_id=team_setup["model"], step=2)
    evaluation = {**{k: body[k] for k in ("task_set", "environment", "reward")}, "checkpoint": checkpoint.pk}
    evaluation_file = tmp_path / "evaluation.json"
    evaluation_file.write_text(json.dumps({**evaluation, "max_new_tokens": 4}))
    usage = artweb("evaluations", "create", "-f", str(evaluation_file), "--fail-below", "0.5", env=env)
    assert usage.returncode == 2 and "--fail-below needs --wait" in usage.stderr
    failing = artweb(
        "evaluations", "create", "-f", str(evaluation_file), "--wait", "--interval", "0.5",
        "--fail-below", "1.01", env=env,
    )  # fmt: skip
    assert failing.returncode == 1 and "FAIL: pass_rate" in failing.stdout, failing.stdout + failing.stderr
    passing = artweb(
        "evaluations", "create", "-f", str(evaluation_file), "--wait", "--interval", "0.5",
        "--fail-below", "0", "--metric", "reward_mean", env=env,
    )  # fmt: skip
    assert passing.returncode == 0 and "PASS: reward_mean" in passing.stdout, passing.stdout + passing.stderr

    # The adapter, as a PEFT-loadable archive.
    archive = tmp_path / "adapter.tar.gz"
    downloaded = artweb("checkpoints", "download", str(checkpoint.pk), "-o", str(archive), env=env)
    assert downloaded.returncode == 0, downloaded.stderr
    with tarfile.open(archive) as tar:
        names = {Path(name).name for name in tar.getnames()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names, names
    missing = artweb("checkpoints", "download", "999999", "-o", str(tmp_path / "x"), env=env)
    assert missing.returncode == 2 and "HTTP 404" in missing.stderr
