"""The ``artweb`` command line as a CI job uses it, against the real stack (web under uvicorn,
a Celery worker, the inference server; tests/browser/conftest.py): log in, start a run and wait for
it, evaluate with a pass threshold, download the adapter. Exit codes are what pipelines branch on.
Output goes through real pipes: one that the test reads, and one already closed (``| head``)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from projects import services
from projects.models import BaseModel, Checkpoint, Evaluation, Run, RunStatus
from tests.browser.conftest import stack  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ROWS = "".join(json.dumps({"prompt": f"Say {w}", "item": {"answer": w}}) + "\n" for w in "abcd")


def artweb(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "artweb.cli", *args],
        env=env, input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def artweb_into_closed_pipe(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """As ``artweb ... | head`` once head has gone: the pipe's read end is closed before the
    command starts, so its first write to stdout fails, every time."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "artweb.cli", *args],
            env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
        )  # fmt: skip
    finally:
        os.close(write)


def bar_frames(stderr: str) -> list[str]:
    """The progress bar's successive renderings (tqdm redraws with a carriage return)."""
    return [frame for frame in re.split(r"[\r\n]", stderr) if frame.startswith("run ")]


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
    # The key through a pipe, as a CI job passes a secret (not on the command line).
    login = subprocess.run(
        ["bash", "-c", f'echo "$KEY" | {sys.executable} -m artweb.cli login --url "$URL"'],
        env={**env, "KEY": team_setup["key"], "URL": stack.web.url},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert login.returncode == 0 and "Signed in to" in login.stdout, login.stderr
    assert team_setup["key"] not in login.stdout + login.stderr
    saved = Path(env["ARTWEB_CONFIG"])
    assert json.loads(saved.read_text())["base_url"] == stack.web.url
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600  # a secret: only its owner reads it

    # Input the API refuses: exit 2 with the field and the reason.
    body = {key: team_setup[key] for key in ("model", "task_set", "environment", "reward")}
    bad = artweb("runs", "create", "-f", "-", env=env, stdin=json.dumps({**body, "config": {"lr": 1}}))
    assert bad.returncode == 2 and "HTTP 400" in bad.stderr and "learning_rate" in bad.stderr, bad.stderr
    # The API's message names the field already: printed once.
    small = artweb(
        "runs", "create", "-f", "-", env=env, stdin=json.dumps({**body, "config": {"group_size": 1}})
    )
    assert small.returncode == 2 and small.stderr.count("config.group_size") == 1, small.stderr
    not_json = artweb("runs", "create", "-f", "-", env=env, stdin="{not json")
    assert not_json.returncode == 2 and "not valid JSON" in not_json.stderr

    # A run followed to its end: exit 0, the per-step bar and the outcome line.
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({**body, "config": {"steps": 3, "group_size": 2, "max_new_tokens": 4}}))
    created = artweb("runs", "create", "-f", str(run_file), "--wait", "--interval", "0.5", env=env)
    assert created.returncode == 0, created.stdout + created.stderr
    run = Run.objects.get()
    assert run.status == RunStatus.SUCCEEDED
    assert created.stdout.rstrip().endswith(f"Run {run.pk} succeeded after 3/3 steps"), created.stdout
    assert "reward=" in created.stderr and "loss=" in created.stderr  # the bar's postfix
    assert "rollouts" in created.stdout  # phase lines, timestamped
    # A speed only once two steps were seen finishing (the first starts the clock), and one shown.
    frames = bar_frames(created.stderr)
    timed = [frame for frame in frames if re.search(r"step/s|s/step", frame)]
    assert timed, frames
    assert all(re.search(r"\| [23]/3 \[", frame) for frame in timed), timed
    # The run's validation evaluations (its first and last step), with their results.
    evaluations = list(Evaluation.objects.filter(run=run).order_by("step"))
    assert [evaluation.step for evaluation in evaluations] == [0, 3]
    for evaluation in evaluations:
        results = evaluation.results
        assert (
            f"Evaluation {evaluation.pk} at step {evaluation.step} (validation, n={results['n']}):"
            f" reward_mean {results['reward_mean']:.4g}, pass_rate {results['pass_rate']:.4g}"
        ) in created.stdout, created.stdout

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
    assert "(reward >= 1)" in failing.stdout  # the threshold the pass rate counts against
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


def test_watching_a_finished_run_summarises_it_and_a_closed_pipe_ends_quietly(stack, team_setup, tmp_path):  # noqa: F811
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARTWEB_")}
    env |= {"ARTWEB_CONFIG": str(tmp_path / "credentials.json"), "ARTWEB_BASE_URL": stack.web.url}
    env["ARTWEB_API_KEY"] = team_setup["key"]
    body = {key: team_setup[key] for key in ("model", "task_set", "environment", "reward")}
    config = {"steps": 2, "group_size": 2, "max_new_tokens": 4}
    created = artweb(
        "runs",
        "create",
        "-f",
        "-",
        "--wait",
        "--interval",
        "0.5",
        env=env,
        stdin=json.dumps({**body, "config": config}),
    )
    assert created.returncode == 0, created.stdout + created.stderr
    run = Run.objects.get()

    # Watching it afterwards: its history in brief (not every phase again), no speed made up from
    # steps that finished before the watch, its evaluations, then the outcome.
    watched = artweb("runs", "watch", str(run.pk), "--interval", "0.2", env=env)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    lines = watched.stdout.splitlines()
    assert lines[0].startswith(f"Run {run.pk} succeeded, 2/2 steps done before this watch"), lines
    phases = list(run.events.filter(data__has_key="phase").order_by("id").values_list("message", flat=True))
    assert len(set(phases)) > 2  # loading, rollouts, grading, ... each step: the watch shows the last
    shown = [line for line in lines if any(line.endswith(f" INFO  {message}") for message in phases)]
    assert len(shown) == 1 and shown[0].endswith(phases[-1]), lines
    for evaluation in Evaluation.objects.filter(run=run):
        assert any(
            line.startswith(f"Evaluation {evaluation.pk} at step {evaluation.step} ") for line in lines
        )
    assert lines[-1] == f"Run {run.pk} succeeded after 2/2 steps", lines
    frames = bar_frames(watched.stderr)
    assert frames and all("2/2" in frame for frame in frames), frames
    assert not re.search(r"step/s|s/step| left", watched.stderr), watched.stderr

    # Into a closed pipe: every command stops quietly with 141 (as `yes | head` leaves), after
    # doing its work; an error still says what it is, with its own exit code.
    checkpoint = Checkpoint.objects.get(run=run, step=2)
    archive = tmp_path / "adapter.tar.gz"
    commands = [
        ("runs", "get", str(run.pk)),
        ("runs", "watch", str(run.pk)),
        ("checkpoints", "download", str(checkpoint.pk), "-o", str(archive)),
        ("login", "--url", stack.web.url, "--api-key", team_setup["key"]),
    ]
    for command in commands:
        cut = artweb_into_closed_pipe(*command, env=env)
        assert cut.returncode == 141, (command, cut.returncode, cut.stderr)
        assert "Traceback" not in cut.stderr and "BrokenPipe" not in cut.stderr, (command, cut.stderr)
    assert archive.stat().st_size > 0 and json.loads(Path(env["ARTWEB_CONFIG"]).read_text())["api_key"]
    missing = artweb_into_closed_pipe("runs", "get", "999999", env=env)
    assert missing.returncode == 2 and "HTTP 404" in missing.stderr, missing.stderr
