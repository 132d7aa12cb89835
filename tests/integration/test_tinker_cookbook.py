"""tinker-cookbook 0.6.1's own supervised and RL loops (``supervised.train.main``,
``rl.train.main``), unchanged, train on a live artweb through the unmodified ``tinker`` SDK: web
under uvicorn, a real Celery worker, the host's trainer service, the tiny model, no network.

The cookbook runs in its own virtualenv (``.venv-cookbook``, made by ``make install``) as a
subprocess (tests/integration/cookbook_script.py). What needs the network in the cookbook is
replaced from outside, never edited: the tokenizer is registered under the base model's name from
its local folder, datasets are a local JSONL file and an in-script env, the price list is not
fetched. Left off because artweb does not offer them: KL penalties and test-set NLL (prompt
logprobs), async RL's stable_reinforce, rolling checkpoint deletion.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from projects import services
from projects.models import Checkpoint, Run, RunKind, StepMetrics
from tests.conftest import trainer_service
from tests.integration.conftest import ROOT
from tests.projects.gateway.conftest import (  # noqa: F401  (fixtures)
    BASE_MODEL,
    gateway,
    inference_server,
    register_base_model,
    serving,
)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

COOKBOOK_PYTHON = ROOT / ".venv-cookbook" / "bin" / "python"
SCRIPT = ROOT / "tests" / "integration" / "cookbook_script.py"


def test_the_cookbooks_sl_and_rl_loops_train_on_artweb_unchanged(
    gateway,  # noqa: F811  (the fixture imported above)
    serving,  # noqa: F811
    start_worker,
    tiny_model_dir,
    cast,
    tmp_path,
):
    if not COOKBOOK_PYTHON.exists():
        pytest.fail(f"{COOKBOOK_PYTHON} is missing: `make install` creates the cookbook's virtualenv")
    register_base_model(tiny_model_dir)
    key = services.api_key_create(team=cast.alpha, name="cookbook").plaintext
    with trainer_service(serving.data_dir / "checkpoints", tiny_model_dir.parent, token="t-cook") as service:
        worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), TRAINER_SERVICE_URL=service.url,
                              TRAINER_SERVICE_TOKEN="t-cook", TINKER_POLL_S="5")  # fmt: skip
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "NO_PROXY": "*"}
        done = subprocess.run(
            [str(COOKBOOK_PYTHON), str(SCRIPT), "--base-url", gateway.url, "--api-key", key,
             "--base-model", BASE_MODEL, "--tokenizer", str(tiny_model_dir), "--log-dir", str(tmp_path / "runs"),
             "--renderer", "qwen3_instruct", "--download"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"the cookbook failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}\n"
                    f"worker log:\n{worker.output()[-3000:]}")  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    print(json.dumps({k: result[k] for k in ("sl", "rl")}, indent=1, default=str))
    assert result["sl"]["ok"] and result["rl"]["ok"], result
    assert result["sl"]["reached_final_checkpoint"] and result["rl"]["reached_final_checkpoint"]
    # What needs prompt logprobs (a sampler's compute_logprobs) ran: the SL loop's held-out NLL, and
    # RL's KL penalty against the base model (0 before the first update: the policy is the base;
    # after it, a sampled estimate of either sign, seen +0.014, -0.008 and -7.2e-05, but no longer 0:
    # before the update it is float noise, seen 2.2e-08) and its KL between the policies before and
    # after each update.
    held_out = [row["test/nll"] for row in result["sl"]["steps"] if "test/nll" in row]
    assert len(held_out) == 2 and all(v > 0 for v in held_out), result["sl"]["steps"]
    first, second = result["rl"]["steps"]
    assert abs(first["kl_policy_base"]) < 1e-6 < abs(second["kl_policy_base"]), result["rl"]["steps"]
    assert all(step["kl_pre_post_v2"] > 0 for step in (first, second))

    # Each loop's training client is a run of kind tinker, closed by the loop's end as succeeded;
    # so are the two the downloads loaded the SL state into (after SL, before RL), which trained nothing.
    runs = list(Run.objects.filter(kind=RunKind.TINKER, project__team=cast.alpha).order_by("id"))
    assert [run.status for run in runs] == ["succeeded"] * 4
    sl, *loaded, rl = runs
    assert [StepMetrics.objects.filter(run=run).count() for run in loaded] == [0, 0]
    assert StepMetrics.objects.filter(run=sl).count() == 3 and StepMetrics.objects.filter(run=rl).count() == 2
    for run in (sl, rl):
        final = Checkpoint.objects.get(model=run.model, step=run.current_step)
        assert {"weights/final", "sampler_weights/final"} <= set(final.metrics["tinker_names"])
    assert "Traceback" not in worker.output()

    # tinker_cookbook.weights.download, unchanged: the SL loop's final state (exported encrypted to a
    # one-off key, decrypted, the export deleted) and a plain export saved by name with a TTL: both
    # are the final checkpoint's adapter, tensor for tensor, and nothing else.
    download = result["download"]
    assert download["training_files"] == download["external_files"] == [
        "adapter_config.json", "adapter_model.safetensors"]  # fmt: skip
    final = Checkpoint.objects.get(model=sl.model, step=sl.current_step)
    expected = load_file(os.path.join(final.path, "adapter_model.safetensors"))  # the worker's own folder
    for folder in (download["training_dir"], download["external_dir"]):
        got = load_file(os.path.join(folder, "adapter_model.safetensors"))
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    # The one-off encrypted export is gone again; the named one is listed with its expiry.
    (listed,) = [row for row in download["listed"] if row[1] == "external"]
    assert listed[0] == "external_weights/plain" and listed[2] != "None"
    assert not any("external_weights/download" in name for c in Checkpoint.objects.all()
                   for name in c.metrics.get("tinker_names", {}))  # fmt: skip
