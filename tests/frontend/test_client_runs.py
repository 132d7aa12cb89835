"""The dashboard shows client-driven training like a platform run: the model page lists its client
run, whose page has the steps' charts, checkpoints and events (and no cancel button: its client
drives it), and the trajectory viewer shows each step's trajectories."""

from __future__ import annotations

import pytest
from django.test import Client

from projects import services

pytestmark = pytest.mark.django_db


@pytest.fixture
def trained(cast):
    services.base_model_register(name="tiny", source="/nowhere")
    model, run = services.client_model_register(
        team=cast.alpha, entity=None, project="games", name="agent", base_model="tiny"
    )
    groups = [{"trajectories": [
        {"messages_and_choices": [{"role": "user", "content": "Your move"},
                                  {"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "corner"},
                                   "logprobs": {"content": [{"token": "corner", "logprob": -0.1}]}}],
         "reward": reward} for reward in (0.0, 1.0)]}]  # fmt: skip
    job = services.training_job_create(model=model, trajectory_groups=groups)
    job = services.training_job_claim(job_id=job.pk, worker="w")
    records = [
        services.TrajectoryRecord(
            group_index=0, sample_index=i, task_row_index=None,
            messages=[{"role": "user", "content": "Your move"}, {"role": "assistant", "content": "corner"}],
            reward=float(i), sub_rewards={}, errors=[], metrics={"token_source": "gateway"},
            prompt_tokens=5, completion_tokens=2, finish_reason="stop",
        )
        for i in range(2)
    ]  # fmt: skip
    metrics = {"reward_mean": 0.5, "reward_std": 0.5, "loss": 0.1, "grad_norm": 0.2, "entropy": 1.0,
               "kl": 0.0, "clip_fraction": 0.0, "zero_variance_fraction": 0.0}  # fmt: skip
    assert services.training_job_finish(job=job, worker="w", step=1, checkpoint_path="/nowhere/step-000001",
                                        metrics=metrics, events=[{"loss": 0.1}], trajectories=records)  # fmt: skip
    return model, run


def test_the_client_run_shows_like_a_run(trained, cast):
    model, run = trained
    page = Client()
    page.force_login(cast.alice)
    model_page = page.get(f"/models/{model.pk}/").content.decode()
    assert f"/runs/{run.pk}/" in model_page and "data-parallel" not in model_page
    services.trainable_model_update(model=model, devices=2)
    assert "train data-parallel on 2 devices" in page.get(f"/models/{model.pk}/").content.decode()
    detail = page.get(f"/runs/{run.pk}/").content.decode()
    assert "client run" in detail and "step 1" in detail and "Cancel run" not in detail
    assert page.get(f"/runs/{run.pk}/metrics.json").status_code == 200
    assert "corner" in page.get(f"/runs/{run.pk}/trajectories").content.decode()
    checkpoint = model.checkpoints.get(step=0)
    assert page.get(f"/checkpoints/{checkpoint.pk}/").status_code == 200  # step 0: the base model
