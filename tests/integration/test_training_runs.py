"""A real Celery worker trains a real (tiny) model end to end against PostgreSQL and Redis."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from projects import services
from projects.models import Checkpoint, Run, RunEvent, RunStatus, StepMetrics, Trajectory
from tests.conftest import trainer_service
from tests.integration.conftest import wait_for
from tests.projects.gateway.conftest import serving  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}
SMALL = {"group_size": 4, "groups_per_step": 2, "max_new_tokens": 8}


@pytest.fixture
def api(cast, alpha_key):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {alpha_key}")
    return client


@pytest.fixture
def inputs(cast, tiny_model_dir, api):
    """Project, model, task set, environment and reward created through the REST API."""
    services.base_model_register(name="tiny", source=str(tiny_model_dir))
    project = api.post("/api/v1/projects/", {"name": "it"}, format="json").json()["id"]
    rows = [{"prompt": f"Say {word}", "item": {"answer": word}} for word in ["a", "b", "c", "d", "e"]]
    ids = {
        "task_set": api.post(
            "/api/v1/task-sets/", {"project": project, "name": "words", "rows": rows}, format="json"
        ),
        "environment": api.post("/api/v1/environments/", {"project": project, "name": "chat"}, format="json"),
        "reward": api.post(
            "/api/v1/reward-definitions/",
            {"project": project, "name": "has-a", "spec": {"type": "regex", "pattern": "a"}},
            format="json",
        ),
    }
    for name, response in ids.items():
        assert response.status_code == 201, (name, response.json())
    result = {name: response.json()["id"] for name, response in ids.items()}
    result["project"] = project
    return result


def create_run(api, inputs, model_name: str, **config) -> int:
    model = api.post(
        "/api/v1/models/",
        {"project": inputs["project"], "name": model_name, "base_model": "tiny"},
        format="json",
    )
    assert model.status_code == 201, model.json()
    body = {
        "model": model.json()["id"], "task_set": inputs["task_set"], "environment": inputs["environment"],
        "reward": inputs["reward"], "config": {**SMALL, **config},
    }  # fmt: skip
    response = api.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201, response.json()
    return response.json()["id"]


def status_of(run_id: int) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run_id)


def test_run_succeeds_with_metrics_trajectories_and_checkpoint_files(start_worker, api, inputs):
    worker = start_worker()
    run_id = create_run(api, inputs, "m1", steps=3)
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=180, what="run to finish", worker=worker)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, worker.output()[-3000:])
    metrics = api.get(f"/api/v1/runs/{run_id}/metrics/").json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["reward_mean"] is not None and m["loss"] is not None
        assert m["metrics"]["completion_tokens"] > 0 and "grad_norm" in m["metrics"]
    assert Trajectory.objects.filter(run=run).count() == 3 * 2 * 4
    trajectory = api.get(f"/api/v1/runs/{run_id}/trajectories/?step=2").json()["data"][0]
    assert trajectory["messages"][-1]["role"] == "assistant" and trajectory["completion_tokens"] > 0
    checkpoints = Checkpoint.objects.filter(run=run).order_by("step")
    assert [c.step for c in checkpoints] == [0, 1, 2, 3]
    for checkpoint in checkpoints:
        files = {p.name for p in Path(checkpoint.path).iterdir()}
        assert {"adapter_model.safetensors", "adapter_config.json", "state.json"} <= files, files
    levels = set(RunEvent.objects.filter(run=run).values_list("level", flat=True))
    assert "error" not in levels


def test_a_run_trains_on_the_hosts_trainer_service_and_survives_its_worker(start_worker, api, inputs, tmp_path,
                                                                          tiny_model_dir):  # fmt: skip
    """With a trainer service on the host (as under `manage.py up`), the run's session lives there:
    the worker loads no model. The worker is SIGKILLed after step 2 while it holds the session's
    lease; the next worker takes the session over (its claim on the run is the authority), resumes
    from the last checkpoint, and every step is recorded once; the session is closed at the end."""
    data_dir = tmp_path / "service-host"
    with trainer_service(data_dir / "checkpoints", tiny_model_dir.parent, token="t-runs") as service:
        env = {
            "ARTWEB_DATA_DIR": str(data_dir),
            "TRAINER_SERVICE_URL": service.url,
            "TRAINER_SERVICE_TOKEN": "t-runs",
        }
        first = start_worker(**env)
        run_id = create_run(api, inputs, "on-service", steps=5)
        wait_for(
            lambda: Run.objects.get(pk=run_id).current_step >= 2, timeout=180, what="two steps", worker=first
        )
        first.kill()
        held = service.stats()["held"]
        assert list(held) == [f"run-{run_id}"], held  # the dead worker's lease still runs
        second = start_worker(**env)
        wait_for(lambda: status_of(run_id) in TERMINAL, timeout=240, what="the resumed run", worker=second)
        stats = service.stats()
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, second.output()[-3000:])
    assert run.attempts == 2
    assert list(StepMetrics.objects.filter(run=run).order_by("step").values_list("step", flat=True)) == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert [c.step for c in Checkpoint.objects.filter(model=run.model).order_by("step")] == list(range(6))
    opened = RunEvent.objects.filter(
        run=run, message__startswith=f"Opened session run-{run_id} on the trainer service"
    )
    assert opened.count() == 2
    assert not RunEvent.objects.filter(
        run=run, message__contains="Loaded base model"
    ).exists()  # no model in the worker
    assert stats["sessions"] == 0 and stats["base_loads"] == 1 and stats["primitives_run"] > 10, stats


def test_a_two_device_run_takes_its_updates_data_parallel_and_survives_its_worker(start_worker, api, inputs):
    """``devices: 2`` through the API and real workers: the worker's task process starts the second
    rank (gloo) and every update with a signal runs on both. The worker is SIGKILLed after step 1:
    its follower exits on its own, and a second worker resumes the run (with a new follower) to
    the end, every step recorded once."""
    first = start_worker()
    run_id = create_run(api, inputs, "ddp", steps=3, devices=2)
    wait_for(
        lambda: Run.objects.get(pk=run_id).current_step >= 1, timeout=240, what="a first step", worker=first
    )
    (follower,) = [pid for pid in _follower_pids() if first.process.pid in _ancestors(pid)]
    # Kill only the process running the task (the follower's parent, a Celery pool process), as an
    # out-of-memory kill would: the follower must notice and exit on its own.
    task_process = int(Path(f"/proc/{follower}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(task_process, signal.SIGKILL)
    wait_for(lambda: follower not in _follower_pids(), timeout=15, what="the orphaned follower to exit")
    first.kill()
    second = start_worker()
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=240, what="the resumed run", worker=second)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, second.output()[-3000:])
    assert (
        RunEvent.objects.filter(run=run, message__contains="data-parallel on 2 devices (gloo)").count() == 2
    )
    metrics = api.get(f"/api/v1/runs/{run_id}/metrics/").json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    updated = [m["metrics"].get("update_devices") for m in metrics if m["metrics"]["trainable_tokens"] > 0]
    assert updated and updated == [2.0] * len(updated)


def test_an_overlapped_run_records_staleness_and_resumes_after_its_worker_is_killed(
    start_worker, api, inputs
):
    """``max_off_policy_steps: 1`` through the API and real workers: the updates run on the task's
    update thread while the next rollouts run; every trajectory stores the checkpoint it was
    sampled from. The worker is killed after step 2 and another resumes the run to the end, each
    step recorded once; the resumed steps sample what an uninterrupted run's would (one update
    behind, the checkpoint before the resume point fetched again), not the resume checkpoint."""
    first = start_worker()
    run_id = create_run(api, inputs, "overlap", steps=5, max_off_policy_steps=1)
    wait_for(
        lambda: Run.objects.get(pk=run_id).current_step >= 2, timeout=240, what="two steps", worker=first
    )
    first.kill()
    second = start_worker()
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=240, what="the resumed run", worker=second)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, second.output()[-3000:])
    metrics = api.get(f"/api/v1/runs/{run_id}/metrics/").json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    behind = [m["metrics"]["off_policy_steps"] for m in metrics]
    assert behind == [0.0, 1.0, 1.0, 1.0, 1.0], behind
    for step, stale in zip(range(1, 6), behind, strict=True):
        stored = Trajectory.objects.filter(run=run, step=step)
        assert stored.count() == 8
        assert {t.metrics["off_policy_steps"] for t in stored} == {stale}
        assert {t.metrics["policy_step"] for t in stored} == {step - 1 - int(stale)}
    assert [c.step for c in Checkpoint.objects.filter(model=run.model).order_by("step")] == list(range(0, 6))
    assert "Traceback" not in second.output()


def _ancestors(pid: int) -> list[int]:
    """The process's parent, its parent's parent, ... (the other shard of `make test` runs followers
    of its own at the same time: a test picks out those of its worker by this)."""
    found = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            break
        found.append(pid)
    return found


def _follower_pids() -> list[int]:
    """Live ``python -m training.hosting.follower`` processes on this machine (their command lines)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
                status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b"training.hosting.follower" in command and status != "Z":
                pids.append(int(entry.name))
    return pids


def test_cancel_stops_run_within_one_step(start_worker, api, inputs):
    worker = start_worker()
    run_id = create_run(api, inputs, "m2", steps=200)
    wait_for(
        lambda: Run.objects.get(pk=run_id).current_step >= 1,
        timeout=180,
        what="the first step",
        worker=worker,
    )
    response = api.post(f"/api/v1/runs/{run_id}/cancel/")
    assert response.status_code == 200
    step_at_cancel = response.json()["current_step"]
    wait_for(
        lambda: status_of(run_id) == RunStatus.CANCELLED, timeout=120, what="cancellation", worker=worker
    )
    recorded = StepMetrics.objects.filter(run_id=run_id).count()
    assert recorded <= step_at_cancel + 1, (recorded, step_at_cancel)


def test_killed_worker_run_resumes_from_last_checkpoint_exactly_once(start_worker, api, inputs):
    first = start_worker()
    run_id = create_run(api, inputs, "m3", steps=8, max_new_tokens=12)
    wait_for(
        lambda: Run.objects.get(pk=run_id).current_step >= 2, timeout=180, what="two steps", worker=first
    )
    first.kill()
    killed_at = Run.objects.get(pk=run_id).current_step
    assert status_of(run_id) == RunStatus.RUNNING
    second = start_worker()
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=240, what="the resumed run", worker=second)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, second.output()[-3000:])
    assert run.attempts == 2
    steps = list(StepMetrics.objects.filter(run=run).order_by("step").values_list("step", flat=True))
    assert steps == list(range(1, 9)), "every step recorded exactly once"
    trajectories_per_step = {
        step: Trajectory.objects.filter(run=run, step=step).count() for step in range(1, 9)
    }
    assert set(trajectories_per_step.values()) == {8}, trajectories_per_step
    assert [c.step for c in Checkpoint.objects.filter(model=run.model).order_by("step")] == list(range(0, 9))
    resumed = RunEvent.objects.filter(run=run, message__contains="resuming").first()
    assert resumed is not None and f"from step {killed_at}" in resumed.message or killed_at < 8


def test_failures_are_readable_and_keep_what_was_recorded(start_worker, api, inputs, tiny_model_dir):
    worker = start_worker()
    # A reward that errors on every sample: the run fails naming the grader and an example.
    bad_reward = api.post(
        "/api/v1/reward-definitions/",
        {
            "project": inputs["project"],
            "name": "broken",
            "spec": {"type": "regex", "pattern": "{{item.missing}}"},
        },
        format="json",
    ).json()["id"]
    run_id = create_run(api, {**inputs, "reward": bad_reward}, "m4", steps=2)
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=180, what="the failing run", worker=worker)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.FAILED
    assert "broken" in run.error and "item.missing" in run.error, run.error
    assert Checkpoint.objects.filter(run=run, step=0).exists(), "the step-0 checkpoint stays recorded"
    assert RunEvent.objects.filter(run=run, level="error").exists()
    # An engine that cannot load: a readable message, not a traceback.
    services.base_model_register(name="gone", source=str(tiny_model_dir.parent / "does-not-exist"))
    model = api.post(
        "/api/v1/models/", {"project": inputs["project"], "name": "m5", "base_model": "gone"}, format="json"
    )
    body = {"model": model.json()["id"], "task_set": inputs["task_set"], "environment": inputs["environment"],
            "reward": inputs["reward"], "config": {**SMALL, "steps": 1}}  # fmt: skip
    run_id = api.post("/api/v1/runs/", body, format="json").json()["id"]
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=120, what="the unloadable run", worker=worker)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.FAILED and "does-not-exist" in run.error, run.error


def test_worker_logs_json_lines_naming_the_run(start_worker, api, inputs):
    """LOG_FORMAT=json (artweb.logs): the worker's log is one JSON object per line, and the lines
    written while it trains a run carry that run's id."""
    worker = start_worker(LOG_FORMAT="json")
    run_id = create_run(api, inputs, "logged", steps=1)
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=180, what="run to finish", worker=worker)
    wait_for(lambda: "succeeded in" in worker.output(), timeout=30, what="the task's end line", worker=worker)
    logged = [line for line in worker.output().splitlines() if line.startswith("{")]
    lines = [json.loads(line) for line in logged]
    assert {"ts", "level", "logger", "message"} <= set(lines[0])
    steps = [line for line in lines if line["message"].startswith("step 1 done in")]
    assert len(steps) == 1 and steps[0]["run_id"] == run_id, steps
    # Celery's own lines are JSON too; only its start-up banner (printed, not logged) is not.
    banner_end = next(i for i, line in enumerate(worker.output().splitlines()) if "ready." in line)
    after_banner = [line for line in worker.output().splitlines()[banner_end:] if line.strip()]
    assert all(line.startswith("{") for line in after_banner), after_banner[:5]


def test_an_sft_run_trains_on_the_rows_targets_and_an_rl_run_continues_it(start_worker, api, inputs):
    rows = [{"prompt": f"Say {w}", "completion": f"{w} {w}", "item": {"answer": w}} for w in "abcdef"]
    sft_set = api.post("/api/v1/task-sets/", {"project": inputs["project"], "name": "targets", "rows": rows,
                                              "validation_fraction": 0.34}, format="json")  # fmt: skip
    assert sft_set.status_code == 201, sft_set.json()
    model = api.post("/api/v1/models/", {"project": inputs["project"], "name": "sft", "base_model": "tiny"},
                     format="json").json()["id"]  # fmt: skip
    body = {"kind": "dpo", "model": model, "task_set": sft_set.json()["id"], "environment": inputs["environment"],
            "reward": inputs["reward"], "config": {"steps": 3, "groups_per_step": 2, "learning_rate": 1e-2}}  # fmt: skip
    refused = api.post("/api/v1/runs/", body, format="json")  # rows without chosen / rejected
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "task_set", refused.json()
    assert "chosen" in refused.json()["error"]["message"]
    worker = start_worker()
    created = api.post("/api/v1/runs/", {**body, "kind": "sft"}, format="json")
    assert created.status_code == 201 and created.json()["kind"] == "sft", created.json()
    run_id = created.json()["id"]
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=180, what="SFT run to finish", worker=worker)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, worker.output()[-3000:])
    metrics = api.get(f"/api/v1/runs/{run_id}/metrics/").json()["data"]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss"] > 0 for m in metrics)
    before = RunEvent.objects.get(run=run, message__startswith="Held-out before training").data[
        "heldout_loss"
    ]
    assert metrics[-1]["metrics"]["heldout_loss"] < before
    assert not Trajectory.objects.filter(run=run).exists()
    assert [c.step for c in Checkpoint.objects.filter(run=run).order_by("step")] == [0, 1, 2, 3]
    # An RL run on the same model starts from the SFT run's last checkpoint.
    rl = api.post("/api/v1/runs/", {"model": model, "task_set": inputs["task_set"], "environment": inputs["environment"],
                                    "reward": inputs["reward"], "config": {**SMALL, "steps": 1}}, format="json")  # fmt: skip
    assert rl.status_code == 201 and rl.json()["start_step"] == 3 and rl.json()["kind"] == "platform"
    wait_for(
        lambda: status_of(rl.json()["id"]) in TERMINAL, timeout=180, what="RL run to finish", worker=worker
    )
    assert status_of(rl.json()["id"]) == RunStatus.SUCCEEDED
    assert Checkpoint.objects.filter(model_id=model, step=4).exists()


def test_an_overlapped_runs_rollouts_are_sampled_on_the_base_models_inference_server(
    start_worker,
    api,
    inputs,
    tiny_model_dir,
    serving,  # noqa: F811  (the fixture imported above)
):
    """``rollouts_on: inference_servers`` through the API: the worker finds the live inference
    server of the run's base model in the registry and sends it every rollout (``POST /generate``);
    each checkpoint the server samples is checked against the trainer's policy at its save."""
    from tests.projects.gateway.conftest import BASE_MODEL, SERVER_TOKEN, register_base_model, server_stats

    register_base_model(tiny_model_dir)
    server = serving.start_inference_server()
    worker = start_worker(ARTWEB_DATA_DIR=str(serving.data_dir), INFERENCE_SERVER_TOKEN=SERVER_TOKEN)
    model = api.post(
        "/api/v1/models/",
        {"project": inputs["project"], "name": "remote", "base_model": BASE_MODEL},
        format="json",
    )
    assert model.status_code == 201, model.json()
    body = {
        "model": model.json()["id"], "task_set": inputs["task_set"], "environment": inputs["environment"],
        "reward": inputs["reward"],
        "config": {**SMALL, "steps": 3, "max_off_policy_steps": 1, "rollouts_on": "inference_servers"},
    }  # fmt: skip
    response = api.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201, response.json()
    run_id = response.json()["id"]
    wait_for(lambda: status_of(run_id) in TERMINAL, timeout=240, what="the run", worker=worker)
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.SUCCEEDED, (run.error, worker.output()[-3000:])
    stats = server_stats(server)
    # Every step's rollouts (2 groups of 4, one turn) and each checkpoint's probe went to the server.
    assert stats["requests"] >= 3 * 2 * 4, stats
    assert len(stats["adapters"]["loaded"]) >= 2, stats
    steps = StepMetrics.objects.filter(run=run).order_by("step")
    assert [m.step for m in steps] == [1, 2, 3]
    assert all(m.metrics["sampler_logprob_gap"] <= 1e-4 for m in steps)
    staleness = Trajectory.objects.filter(run=run).values_list("metrics__off_policy_steps", flat=True)
    assert set(staleness) <= {0, 1} and 1 in set(staleness)
