"""examples/tic_tac_toe runs end to end on the tiny model: the real openpipe-art client (its own
virtualenv, ``.venv-art``) drives a live artweb (web under uvicorn, a Celery worker, an inference
server), trains two steps and prints a reward per step and the held-out reward before and after."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunKind, StepMetrics
from tests.integration.conftest import ROOT
from tests.integration.test_art_client import art_python  # noqa: F401  (fixture)
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    gateway,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_tic_tac_toe_example_trains_two_steps_and_prints_a_reward_per_step(
    art_python,  # noqa: F811  (the fixtures imported above)
    serving,  # noqa: F811
    gateway,  # noqa: F811
    start_worker,
    cast,
    tiny_model_dir,
    tmp_path,
):
    register_base_model(tiny_model_dir)  # the transactional tests before this one emptied the tables
    worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir))  # the inference server's checkpoints
    key = services.api_key_create(team=cast.alpha, name="examples").plaintext
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "NO_PROXY": "*"}
    command = [
        str(art_python), str(ROOT / "examples" / "tic_tac_toe" / "main.py"), "--steps", "2",
        "--base-url", f"{gateway.url}/v1", "--api-key", key, "--base-model", BASE_MODEL,
        "--eval-rows", "2", "--learning-rate", "1e-3",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    if done.returncode != 0:
        pytest.fail(
            f"the example failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}\nworker:\n{worker.output()[-3000:]}"
        )

    steps = re.findall(r"^step (\d+) reward (-?[\d.]+)", done.stdout, flags=re.MULTILINE)
    assert [int(step) for step, _ in steps] == [1, 2], done.stdout
    assert all(-1.0 <= float(reward) <= 1.0 for _, reward in steps)
    assert re.search(r"^held-out reward before: -?[\d.]+", done.stdout, flags=re.MULTILINE)
    assert re.search(r"^held-out reward after: -?[\d.]+", done.stdout, flags=re.MULTILINE)
    run = Run.objects.get(kind=RunKind.CLIENT, model__name="tic-tac-toe")
    assert run.current_step == 2
    assert list(StepMetrics.objects.filter(run=run).values_list("step", flat=True)) == [1, 2]
    assert Checkpoint.objects.filter(model=run.model, step=2).exists()
