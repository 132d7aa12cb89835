"""OpenPipe ART's own clients (openpipe-art 0.5.18 and 0.5.23, their ``ServerlessBackend``,
unchanged) train on a live artweb: web under uvicorn, a real Celery worker, an inference server,
the tiny model.

Each client runs in its own virtualenv (``.venv-art``, ``.venv-art23``, made by ``make install``:
ART's pins are not the project's) as a subprocess. 0.5.18 (tests/integration/art_client_script.py):
register, step 0 at once, sampling with logprobs, ``gather_trajectory_groups``, ``backend.train``
three times with each new checkpoint served at once under both of ART's names, a multi-turn
tool-call group, checkpoint listing and deletion, and another team's key refused on every path.
0.5.23 (art23_client_script.py): ``run_name``, its default completion extras, captured exchanges,
``loss_fn`` and the KL penalty, one gradient_step per packed sequence, any name ART accepts, on a
model the team set to ``devices: 2`` over REST (its jobs train data-parallel).
No W&B account, no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunKind, StepMetrics, TrainingJob, Trajectory
from tests.conftest import trainer_service
from tests.integration.conftest import ROOT
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    gateway,
    http,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

ART_PYTHON = ROOT / ".venv-art" / "bin" / "python"
ART23_PYTHON = ROOT / ".venv-art23" / "bin" / "python"
SCRIPT = Path(__file__).with_name("art_client_script.py")
SCRIPT23 = Path(__file__).with_name("art23_client_script.py")
PIPELINE23 = Path(__file__).with_name("art23_pipeline_script.py")


def _python(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"{path} is missing: `make install` creates the ART client's virtualenv")
    return path


@pytest.fixture
def art_python() -> Path:
    return _python(ART_PYTHON)


@pytest.fixture
def live_worker(serving, start_worker, tiny_model_dir):  # noqa: F811  (serving: imported above)
    """A Celery worker beside the gateway and inference server, on the tiny model."""
    register_base_model(tiny_model_dir)  # the transactional tests before this one emptied the tables
    return start_worker(ARTWEB_DATA_DIR=str(serving.data_dir))  # the inference server's checkpoints


def team_keys(cast, name: str) -> tuple[str, str]:
    """A key of team alpha (the client's) and one of team beta (an outsider)."""
    return (services.api_key_create(team=cast.alpha, name=name).plaintext,
            services.api_key_create(team=cast.beta, name="outsider").plaintext)  # fmt: skip


def run_client(python: Path, script: Path, arguments: list[str], *, home: Path, worker: Any) -> dict:
    """Run an ART client script as an ART program runs (its own virtualenv, no W&B, no network);
    what it saw (its ``RESULT`` line), or the test fails with its output and the worker's log."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "WANDB_MODE": "disabled",  # no W&B account, WANDB_API_KEY unset: ART logs nothing there
        "WANDB_SILENT": "true",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list otherwise
        "NO_PROXY": "*",
    }
    done = subprocess.run([str(python), str(script), *arguments], cwd=home, env=env,
                          capture_output=True, text=True, timeout=540)  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"the ART client failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}\n"
            f"worker log:\n{worker.output()[-4000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    print(json.dumps(result, indent=1), file=sys.stderr)  # the figures, for the note
    return result


def test_arts_serverless_backend_trains_on_artweb_unchanged(
    art_python,
    gateway,  # noqa: F811  (the fixture imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
    tmp_path,
):
    # This client's jobs train on the host's trainer service (as under `manage.py up`): the worker
    # claims each job and drives the session the service keeps resident between jobs.
    register_base_model(tiny_model_dir)
    with trainer_service(serving.data_dir / "checkpoints", tiny_model_dir.parent, token="t-art") as service:
        worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=service.url,
                              TRAINER_SERVICE_TOKEN="t-art")  # fmt: skip
        alpha_key, beta_key = team_keys(cast, "art")
        arguments = [
            "--base-url", f"{gateway.url}/v1", "--key", alpha_key, "--other-key", beta_key,
            "--project", "games", "--model", "agent", "--base-model", BASE_MODEL,
        ]  # fmt: skip
        result = run_client(art_python, SCRIPT, arguments, home=tmp_path, worker=worker)
        stats = service.stats()
    assert stats["sessions"] == 1 and stats["base_loads"] == 1 and stats["primitives_run"] >= 6, stats

    assert result["entity"] == "alpha"
    assert {"artweb_model", "prompt_token_ids", "token_ids"} <= set(result["choice_fields"])
    assert [item["step"] for item in result["train"]] == [1, 2, 3]
    assert result["steps_after_delete"] == [3]
    assert len(result["refused"]) == 7 and all("NotFoundError" in line for line in result["refused"])

    # Recorded like a platform run's steps: the dashboard's run page, charts and viewer read these.
    run = Run.objects.get(kind=RunKind.CLIENT, model__name="agent")
    assert run.current_step == 3 and run.project.team == cast.alpha
    assert list(StepMetrics.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3]
    assert list(Checkpoint.objects.filter(model=run.model).values_list("step", flat=True)) == [3]
    stored = Trajectory.objects.filter(run=run)
    assert stored.count() == 3 * 8 + 2
    assert all(t.metrics["token_source"] == "gateway" for t in stored), "trained on the gateway's exact ids"
    tool_turns = [t for t in stored.filter(step=2) if any(m.get("role") == "tool" for m in t.messages)]
    assert len(tool_turns) == 2 and all(t.completion_tokens > 0 for t in tool_turns)
    for job in TrainingJob.objects.filter(model=run.model):
        assert job.status == "succeeded"
        url = f"{gateway.url}/v1/preview/training-jobs/{job.pk}/events"
        assert http("GET", url, key=beta_key)[0] == 404
        assert http("GET", url, key=alpha_key)[0] == 200


def test_arts_newest_client_trains_on_artweb_unchanged(
    gateway,  # noqa: F811  (the fixture imported above)
    live_worker,
    cast,
    tmp_path,
):
    worker = live_worker
    alpha_key, beta_key = team_keys(cast, "art23")
    # ART's client has no field for devices: the team sets it on the model over REST, and the
    # client's `models.create` finds that model. Its jobs then train on 2 gloo ranks in the worker's
    # own pool, ART's loss and its KL penalty split across them.
    status, _, project = http(
        "POST", f"{gateway.url}/api/v1/projects/", key=alpha_key, body={"name": "games"}
    )
    assert status == 201, project
    status, _, model = http("POST", f"{gateway.url}/api/v1/models/", key=alpha_key, body={
        "project": project["id"], "name": "agent-r1", "base_model": BASE_MODEL, "devices": 2})  # fmt: skip
    assert status == 201 and model["devices"] == 2, model
    arguments = [
        "--base-url", f"{gateway.url}/v1", "--key", alpha_key, "--other-key", beta_key,
        "--project", "games", "--model", "agent", "--run-name", "agent-r1", "--base-model", BASE_MODEL,
    ]  # fmt: skip
    result = run_client(_python(ART23_PYTHON), SCRIPT23, arguments, home=tmp_path, worker=worker)

    assert result["entity"] == "alpha" and result["stream_token_ids"] > 0
    assert {"artweb_model", "prompt_token_ids", "token_ids", "art_completion_tokens"} <= set(
        result["choice_fields"]
    )
    assert [item["step"] for item in result["train"]] == [1, 2]
    assert (
        result["events"]["num_sequences"] >= 1
    )  # one gradient_step per optimizer step, each with its figures
    assert {"loss", "grad_norm", "learning_rate"} <= set(result["events"]["gradient_step_keys"])
    assert result["steps_after_delete"] == [3] and "Run #2 (α)" in result["odd_name_reply_model"]
    assert len(result["refused"]) == 7 and all("NotFoundError" in line for line in result["refused"])

    run = Run.objects.get(kind=RunKind.CLIENT, model__name="agent-r1")
    assert list(StepMetrics.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3]
    second = StepMetrics.objects.get(run=run, step=2)
    assert second.metrics["kl"] != 0.0, "the KL penalty against step 0 was computed"
    assert [m["update_devices"] for m in StepMetrics.objects.filter(run=run).order_by("step")
            .values_list("metrics", flat=True)] == [2, 2, 2], "every job trained on the model's 2 ranks"  # fmt: skip
    stored = Trajectory.objects.filter(run=run)
    assert stored.count() == 3 * 8
    # Captured exchanges and messages_and_choices alike trained on the gateway's exact ids.
    assert all(t.metrics["token_source"] == "gateway" for t in stored)
    jobs = list(TrainingJob.objects.filter(model=run.model).order_by("id"))
    assert [job.config["art"]["loss"]["ppo"] for job in jobs] == [False, True, False]
    assert jobs[1].config["art"]["loss"]["kl_penalty_coef"] == 0.1


def test_arts_pipeline_trainer_overlaps_sampling_and_training_on_artweb(
    gateway,  # noqa: F811  (the fixture imported above)
    live_worker,
    cast,
    tmp_path,
):
    worker = live_worker
    key, _ = team_keys(cast, "pipeline")
    arguments = ["--base-url", f"{gateway.url}/v1", "--key", key, "--project", "games",
                 "--run-name", "pipe-r1", "--base-model", BASE_MODEL, "--steps", "3"]  # fmt: skip
    result = run_client(_python(ART23_PYTHON), PIPELINE23, arguments, home=tmp_path, worker=worker)

    assert result["step"] == 3
    # Every step stays callable after the run, each answering as itself.
    assert result["answers"] == {str(step): f"games/pipe-r1:{step}" for step in range(4)}
    # Rollouts sampled the latest step as each landed: more than one step was sampled from.
    assert len(result["sampled_from"]) >= 2, result["sampled_from"]
    jobs = list(TrainingJob.objects.filter(model__name="pipe-r1").order_by("id"))
    assert [job.status for job in jobs] == ["succeeded"] * 3 and [job.step for job in jobs] == [1, 2, 3]
