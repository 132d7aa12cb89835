"""OpenPipe ART's own client (openpipe-art 0.5.18, its ``ServerlessBackend``, unchanged) trains on a
live artweb: web under uvicorn, a real Celery worker, an inference server, the tiny model.

The client runs in its own virtualenv (``.venv-art``, made by ``make install``: ART's pins are not
the project's) as a subprocess (tests/integration/art_client_script.py): register, step 0 at once,
sampling with logprobs, ``gather_trajectory_groups``, ``backend.train`` three times with each new
checkpoint served at once under both of ART's names, a multi-turn tool-call group, checkpoint
listing and deletion, and another team's key refused on every path. No W&B account, no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunKind, StepMetrics, TrainingJob, Trajectory
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
SCRIPT = Path(__file__).with_name("art_client_script.py")


@pytest.fixture
def art_python() -> Path:
    if not ART_PYTHON.exists():
        pytest.fail(f"{ART_PYTHON} is missing: `make install` creates the ART client's virtualenv")
    return ART_PYTHON


def test_arts_serverless_backend_trains_on_artweb_unchanged(
    art_python,
    serving,  # noqa: F811  (the fixtures imported above)
    gateway,  # noqa: F811
    start_worker,
    cast,
    tiny_model_dir,
    tmp_path,
):
    register_base_model(tiny_model_dir)  # the transactional tests before this one emptied the tables
    worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir))  # the inference server's checkpoints
    alpha_key = services.api_key_create(team=cast.alpha, name="art").plaintext
    beta_key = services.api_key_create(team=cast.beta, name="outsider").plaintext
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "WANDB_MODE": "disabled",  # no W&B account, WANDB_API_KEY unset: ART logs nothing there
        "WANDB_SILENT": "true",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price list otherwise
        "NO_PROXY": "*",
    }
    command = [
        str(art_python), str(SCRIPT), "--base-url", f"{gateway.url}/v1", "--key", alpha_key,
        "--other-key", beta_key, "--project", "games", "--model", "agent", "--base-model", BASE_MODEL,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    if done.returncode != 0:
        pytest.fail(
            f"the ART client failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}\n"
            f"worker log:\n{worker.output()[-4000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    print(json.dumps(result, indent=1), file=sys.stderr)  # the figures, for the note

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
