"""A run's spec as the worker builds it (projects.jobs.runs): the worker's settings, the task set's
splits, and the step a first attempt starts from and resumes."""

from __future__ import annotations

import os
import re
from pathlib import Path

from django.conf import settings
from django.test import override_settings

from projects import services
from projects.jobs.hosts import session_host
from projects.jobs.runs import build_run_spec
from training.hosting.service_run import service_refusal


def _run(alpha_setup):
    return services.run_create(
        model=alpha_setup.model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )


def test_the_spec_carries_the_workers_engine_and_loader_settings(alpha_setup, settings):
    settings.TRAINING_ENGINE, settings.TRAINING_UNSLOTH, settings.TRAINING_DEVICE = (
        "transformers",
        "off",
        "cpu",
    )
    spec = build_run_spec(_run(alpha_setup))
    assert (spec.engine, spec.unsloth, spec.device) == ("transformers", "off", "cpu")


def test_the_spec_has_the_train_and_validation_rows_in_index_order(alpha_setup):
    spec = build_run_spec(_run(alpha_setup))
    train = [row["index"] for row in spec.train_rows]
    validation = [row["index"] for row in spec.validation_rows]
    assert train == sorted(train) and validation == sorted(validation)
    assert sorted(train + validation) == list(range(6)) and validation
    assert all("prompt" in row["data"] for row in spec.train_rows)


def test_a_first_attempt_starts_from_and_resumes_the_models_latest_checkpoint(alpha_setup):
    for step in (0, 3):
        services.checkpoint_record(model=alpha_setup.model, run=None, step=step, path=f"/ckpt/{step}")
    run = services.run_claim(run_id=_run(alpha_setup).pk, worker="w1")
    assert run is not None and run.attempts == 1
    spec = build_run_spec(run)
    assert (spec.start_step, spec.resume_step) == (3, 3)


def test_with_a_trainer_service_on_the_host_the_runs_session_goes_there(alpha_setup, settings):
    settings.TRAINER_SERVICE_URL, settings.TRAINER_SERVICE_TOKEN = "http://127.0.0.1:8299/", "t-1"
    run = _run(alpha_setup)
    spec = build_run_spec(run)
    target = spec.host
    assert spec.session_id == f"run-{run.pk}" and target.client.url == "http://127.0.0.1:8299"
    assert target.client.token == "t-1" and target.holder.endswith(f":{os.getpid()}")
    assert target.client.timeout_s == 3600  # a step's rollouts are one call
    # One host per worker: the run opens its session through the object ART jobs and Tinker use.
    assert target is session_host() and target.kind == "service"
    settings.TRAINER_SERVICE_RUNS = False
    assert build_run_spec(run).host is None
    settings.TRAINER_SERVICE_RUNS, settings.TRAINER_SERVICE_URL = True, ""
    spec = build_run_spec(run)
    assert spec.host is session_host() and spec.host.kind == "worker"
    assert service_refusal(spec) == "no trainer service on this host"


def test_rollouts_on_the_inference_servers_go_to_a_live_server_of_the_base_model(alpha_setup, settings):
    import pytest

    from projects.gateway.services import inference_server_heartbeat
    from projects.models import Run

    run = _run(alpha_setup)
    assert build_run_spec(run).rollout_server is None  # the default: rollouts in the worker
    Run.objects.filter(pk=run.pk).update(config={**run.config, "max_off_policy_steps": 1,
                                                 "rollouts_on": "inference_servers"})  # fmt: skip
    run.refresh_from_db()
    base = alpha_setup.model.base_model.name
    with pytest.raises(ValueError, match=f"no inference server of {base} is live"):
        build_run_spec(run)
    # A vLLM server: its dialect, its host's fetcher, the base model's name there, names of the run's own.
    vllm = inference_server_heartbeat(url="http://10.0.0.9:8100", base_model_name=base, engine="vllm",
                                      fetch_url="http://10.0.0.9:8101")  # fmt: skip
    server = build_run_spec(run).rollout_server
    assert (server.url, server.engine, server.fetch_url, server.served_model) == (
        "http://10.0.0.9:8100",
        "vllm",
        "http://10.0.0.9:8101",
        base,
    )
    # The run's names carry a secret part: another run's (or team's) cannot be guessed from its id.
    prefix = server.adapter_prefix
    assert re.fullmatch(rf"run-{run.pk}-[0-9a-f]{{16}}-", prefix), prefix
    with override_settings(INFERENCE_ADAPTER_NAME_KEY="another installation"):
        assert build_run_spec(run).rollout_server.adapter_prefix != prefix
    vllm.delete()
    inference_server_heartbeat(url="http://10.0.0.5:8100", base_model_name=base)
    server = build_run_spec(run).rollout_server
    assert server.url == "http://10.0.0.5:8100" and server.token == settings.INFERENCE_SERVER_TOKEN
    assert server.engine == "transformers"
    # A recorded checkpoint is named by its store key (any host fetches it); one not yet: None.
    checkpoint = services.checkpoint_record(
        model=alpha_setup.model, run=run, step=1, path="/ckpt/m/step-000001"
    )
    assert checkpoint.storage_key == "" and server.locate(Path("/ckpt/m/step-000001")) is None
    type(checkpoint).objects.filter(pk=checkpoint.pk).update(
        storage_key="models/7/step-000001.tar", sha256="ab" * 32
    )
    assert server.locate(Path("/ckpt/m/step-000001")) == ("models/7/step-000001.tar", "ab" * 32)
    assert server.locate(Path("/ckpt/m/step-000002")) is None


def test_the_worker_reads_the_config_as_creation_resolved_it(alpha_setup, monkeypatch):
    """One resolution (issue 53, must-have 3): run_create stores the learning rate it filled in and
    the worker's spec takes the stored config as it is, re-deriving nothing; a row stored before
    creation resolved it (no rate) is resolved by the same function when its worker starts."""
    from training import model_files
    from training.config import TrainConfig
    from training.recipes.schedules import default_learning_rate

    run = _run(alpha_setup)
    width = model_files.hidden_size(alpha_setup.model.base_model.source, settings.MODEL_CACHE_DIR)
    assert run.config["learning_rate"] == default_learning_rate(width)
    # Were the worker to derive the rate again it would see this width (and would check the
    # objective again: the creation's check is the only one).
    monkeypatch.setattr(model_files, "hidden_size", lambda *_: 8192)
    checks = []
    monkeypatch.setattr(TrainConfig, "check_objective", lambda self, objective: checks.append(objective))
    run.config = {**run.config, "learning_rate": 7e-4}  # not any default: read as stored
    run.save(update_fields=["config"])
    assert build_run_spec(run).config == TrainConfig.from_dict(run.config)
    assert checks == []
    monkeypatch.undo()
    run.config = {k: v for k, v in run.config.items() if k != "learning_rate"}  # a legacy row
    run.save(update_fields=["config"])
    assert build_run_spec(run).config.learning_rate == default_learning_rate(width)
