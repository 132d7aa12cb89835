"""OpenPipe ART 0.5.23's own client (tests/integration/art23_client_script.py, unchanged) trains on
a live artweb whose base model the real vLLM serves (its CPU build, `serve_inference --engine
vllm`): the gateway under uvicorn, a real Celery worker, no inference server of artweb's own. The
exact-token path goes through vLLM end to end: ART's default extras (`return_token_ids`,
`return_tokens_as_token_ids`, `nvext`, `chat_template_kwargs`) reach vLLM, each choice comes back
with vLLM's sampled ids and prompt ids, the jobs train on those ids, and each new checkpoint is
loaded into vLLM through its runtime LoRA API and sampled there. The model has one rank (no
`devices: 2`) to keep the test light; tests/integration/test_art_client.py covers two.
"""

from __future__ import annotations

import pytest

from projects.models import InferenceServer, Run, RunKind, StepMetrics, TrainingJob, Trajectory
from tests.integration.conftest import _worker_pool, start_worker  # noqa: F401 (fixtures)
from tests.integration.test_art_client import ART23_PYTHON, SCRIPT23, _python, run_client, team_keys
from tests.vllm.conftest import VLLM_MODEL

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def vllm_worker(serving, live, start_worker):  # noqa: F811
    """A Celery worker training on the vLLM base model, writing checkpoints where vLLM's server
    fetches them from; started once the vLLM server's heartbeat is in this test's database."""
    return start_worker(ARTWEB_DATA_DIR=str(serving.data_dir))


def test_arts_newest_client_trains_on_vllms_exact_tokens(
    vllm_server, vllm_gateway, vllm_worker, cast, tmp_path
):
    # vLLM is the only server of the base model: every completion below is vLLM's.
    assert [row.engine for row in InferenceServer.objects.filter(base_model__name=VLLM_MODEL)] == ["vllm"]
    answered_before = vllm_server.output().count("POST /v1/chat/completions")
    alpha_key, beta_key = team_keys(cast, "art23-vllm")
    arguments = [
        "--base-url", f"{vllm_gateway.url}/v1", "--key", alpha_key, "--other-key", beta_key,
        "--project", "games", "--model", "agent", "--run-name", "agent-r1", "--base-model", VLLM_MODEL,
    ]  # fmt: skip
    result = run_client(_python(ART23_PYTHON), SCRIPT23, arguments, home=tmp_path, worker=vllm_worker)

    # The script checked each reply as ART does: ids against usage, `token_id:N` logprob tokens.
    assert result["entity"] == "alpha" and result["stream_token_ids"] > 0
    assert {"artweb_model", "prompt_token_ids", "token_ids", "art_completion_tokens"} <= set(
        result["choice_fields"]
    )
    assert [item["step"] for item in result["train"]] == [1, 2]
    assert result["events"]["num_sequences"] >= 1
    assert {"loss", "grad_norm", "learning_rate"} <= set(result["events"]["gradient_step_keys"])
    assert result["steps_after_delete"] == [3] and "Run #2 (α)" in result["odd_name_reply_model"]
    assert len(result["refused"]) == 7 and all("NotFoundError" in line for line in result["refused"])

    # vLLM answered them (its access log), and took each trained checkpoint through its LoRA API.
    log = vllm_server.output()
    # 1 + stream + litellm + 8 + 8 + 8 rollouts + 3 after training + the odd model's one
    assert log.count("POST /v1/chat/completions") - answered_before >= 31
    assert "POST /v1/load_lora_adapter" in log

    run = Run.objects.get(kind=RunKind.CLIENT, model__name="agent-r1")
    assert run.model.base_model.name == VLLM_MODEL
    assert list(StepMetrics.objects.filter(run=run).values_list("step", flat=True)) == [1, 2, 3]
    assert StepMetrics.objects.get(run=run, step=2).metrics["kl"] != 0.0, "the KL penalty against step 0"
    metrics = list(StepMetrics.objects.filter(run=run).order_by("step").values_list("metrics", flat=True))
    assert [m["exact_token_fraction"] for m in metrics] == [1.0, 1.0, 1.0]
    # Each step trains the checkpoint that sampled its rollouts, and scores vLLM's ids with vLLM's
    # logprobs: the importance ratio is 1 at float32's tolerance (the sampler check's, 1e-4). Ids
    # off by one token, or a prompt rendered otherwise than vLLM saw it, would move it far off.
    ratios = [m["ratio_mean"] for m in metrics]
    print("importance ratio mean per step (vLLM's logprobs against the trainer's):", ratios)
    assert all(abs(ratio - 1.0) <= 1e-4 for ratio in ratios), ratios
    stored = Trajectory.objects.filter(run=run)
    assert stored.count() == 3 * 8
    # Captured exchanges and messages_and_choices alike trained on the ids vLLM sampled.
    assert all(t.metrics["token_source"] == "gateway" for t in stored)
    jobs = list(TrainingJob.objects.filter(model=run.model).order_by("id"))
    assert [job.status for job in jobs] == ["succeeded"] * 3
    assert [job.config["art"]["loss"]["ppo"] for job in jobs] == [False, True, False]
