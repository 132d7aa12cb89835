"""Runs over REST: create (enqueued after commit), bad config naming the field, one active run per
model, cancel, list filters and cursor pages, events, metrics, checkpoints and trajectories."""

from __future__ import annotations

import pytest

from projects import services
from projects.models import Run, RunStatus, Trajectory
from tests.conftest import error_of

pytestmark = pytest.mark.django_db


# --- runs -----------------------------------------------------------------------------------


def _run_body(setup, **config):
    return {
        "model": setup.model.pk, "task_set": setup.task_set.pk, "environment": setup.environment.pk,
        "reward": setup.reward.pk, "config": {"steps": 2, **config},
    }  # fmt: skip


def test_run_create_enqueues_after_commit(alpha_setup, key_client, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued" and body["total_steps"] == 2 and body["config"]["steps"] == 2
    assert len(callbacks) == 1, "exactly one enqueue, deferred to commit"
    events = key_client.get(f"/api/v1/runs/{body['id']}/events/").json()
    assert events["object"] == "list" and "Run created" in events["data"][0]["message"]


def test_run_bad_config_names_the_field(alpha_setup, key_client):
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, learning_rate="fast"), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "config.learning_rate"
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, bogus=1), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "config.bogus"


def test_run_inputs_must_share_the_project(alpha_setup, key_client, cast):
    other = services.project_create(team=cast.alpha, name="other")
    env = services.environment_create(project=other, name="e")
    body = {**_run_body(alpha_setup), "environment": env.pk}
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "environment"


def test_second_active_run_on_a_model_is_409(alpha_setup, key_client):
    assert key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").status_code == 201
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json")
    assert response.status_code == 409 and error_of(response)["code"] == "model_busy"


def test_a_tinker_client_and_a_platform_run_never_write_one_model_at_once(alpha_setup, key_client, cast):
    # A platform run may continue a Tinker client's model between the client's requests; while a
    # request is pending the run is refused, and while the run is active (or after it trained
    # the model past the client's step) the client's training requests are refused.
    from projects.errors import Conflict
    from projects.models import Checkpoint, Run

    session = services.tinker_session_create(team=cast.alpha, project="math", tags=[], user_metadata=None,
                                             sdk_version="0.38.0")  # fmt: skip
    tinker = services.tinker_model_create(session=session, model_seq_id=0, base_model="tiny", lora_config={})
    future = services.tinker_future_submit(team=cast.alpha, kind="forward_backward", model=tinker, seq_id=1)
    body = {**_run_body(alpha_setup), "model": tinker.model.pk}
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 409 and error_of(response)["code"] == "model_busy"
    assert future.pk in error_of(response)["message"]
    services.tinker_future_finish(future=future, result={})
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201, response.json()
    with pytest.raises(Conflict, match=f"run {response.json()['id']} is training this model"):
        services.tinker_future_submit(team=cast.alpha, kind="optim_step", model=tinker, seq_id=2)
    run = Run.objects.get(pk=response.json()["id"])
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    Checkpoint.objects.create(model=tinker.model, run=run, step=1, path="/x")
    with pytest.raises(Conflict, match="past this training client's step 0"):
        services.tinker_future_submit(team=cast.alpha, kind="optim_step", model=tinker, seq_id=2)


def test_cancel_queued_run_then_cancel_again_is_409(alpha_setup, key_client):
    run_id = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").json()["id"]
    cancelled = key_client.post(f"/api/v1/runs/{run_id}/cancel/")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    again = key_client.post(f"/api/v1/runs/{run_id}/cancel/")
    assert again.status_code == 409


def test_run_list_filters_and_paginates(alpha_setup, key_client):
    run_id = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").json()["id"]
    key_client.post(f"/api/v1/runs/{run_id}/cancel/")
    assert key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").status_code == 201
    assert len(key_client.get("/api/v1/runs/?status=queued").json()["data"]) == 1
    assert len(key_client.get("/api/v1/runs/?status=cancelled").json()["data"]) == 1
    page = key_client.get("/api/v1/runs/?limit=1").json()
    assert page["object"] == "list" and len(page["data"]) == 1 and page["has_more"]
    assert page["first_id"] == page["last_id"] == page["data"][0]["id"]
    rest = key_client.get(f"/api/v1/runs/?limit=1&after={page['last_id']}").json()
    assert len(rest["data"]) == 1 and not rest["has_more"] and rest["data"][0]["id"] != page["last_id"]
    assert {page["data"][0]["id"], rest["data"][0]["id"]} == {run_id, run_id + 1}
    assert key_client.get("/api/v1/runs/?status=bogus").status_code == 400
    assert key_client.get(f"/api/v1/runs/?project={alpha_setup.project.pk + 999}").json()["data"] == []


def test_events_after_cursor(alpha_setup, key_client):
    run_id = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").json()["id"]
    key_client.post(f"/api/v1/runs/{run_id}/cancel/")
    events = key_client.get(f"/api/v1/runs/{run_id}/events/").json()["data"]
    assert len(events) == 2
    after = key_client.get(f"/api/v1/runs/{run_id}/events/?after={events[0]['id']}").json()["data"]
    assert [e["id"] for e in after] == [events[1]["id"]]
    assert after[0]["data"] == {"from": "queued", "to": "cancelled"}
    assert key_client.get(f"/api/v1/runs/{run_id}/events/?after=abc").status_code == 400


def test_metrics_checkpoints_and_trajectories_after_a_recorded_step(alpha_setup, key_client):
    run_id = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").json()["id"]
    run = services.run_claim(run_id=run_id, worker="w1")
    assert run is not None
    record = services.TrajectoryRecord(
        group_index=0, sample_index=0, task_row_index=1, messages=[{"role": "assistant", "content": "1"}],
        reward=1.0, sub_rewards={"exact": 1.0}, errors=[], metrics={}, prompt_tokens=3, completion_tokens=1,
        finish_reason="stop",
    )  # fmt: skip
    assert services.step_record(
        run=run,
        worker="w1",
        step=1,
        metrics={"reward_mean": 1.0, "loss": 0.5},
        trajectories=[record],
        checkpoint_path="/x",
    )
    metrics = key_client.get(f"/api/v1/runs/{run_id}/metrics/").json()["data"]
    assert metrics[0]["step"] == 1 and metrics[0]["reward_mean"] == 1.0
    checkpoints = key_client.get(f"/api/v1/runs/{run_id}/checkpoints/").json()["data"]
    assert checkpoints[0]["model_id"] == "math/agent:1"
    trajectories = key_client.get(f"/api/v1/runs/{run_id}/trajectories/?step=1").json()
    assert len(trajectories["data"]) == 1 and trajectories["data"][0]["sub_rewards"] == {"exact": 1.0}
    assert key_client.get(f"/api/v1/runs/{run_id}/trajectories/?step=2").json()["data"] == []
    assert Trajectory.objects.count() == 1


def test_hyperparameters_have_defaults_and_help(key_client):
    body = key_client.get("/api/v1/hyperparameters").json()
    assert body["learning_rate"]["help"] and "default" in body["group_size"]


def test_schema_and_docs_are_served(anonymous_client):
    schema = anonymous_client.get("/api/v1/schema/")
    assert schema.status_code == 200 and b"/api/v1/runs/" in schema.content
    docs = anonymous_client.get("/api/v1/docs/")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()
    assert b"cdn" not in docs.content.lower()


def test_delete_in_use_reward_is_409(alpha_setup, key_client):
    key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json")
    response = key_client.delete(f"/api/v1/reward-definitions/{alpha_setup.reward.pk}/")
    assert response.status_code == 409


def test_run_status_field_is_one_of_the_machine_states(alpha_setup, key_client):
    run = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json").json()
    assert run["status"] in RunStatus.values


def test_run_create_checks_max_new_tokens_and_prompts_against_the_base_model_context(
    alpha_setup, key_client, tiny_model_dir
):
    # The tiny model's config.json says 1024 positions: read without loading its weights.
    services.base_model_register(name=alpha_setup.model.base_model.name, source=str(tiny_model_dir))
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, max_new_tokens=5000), format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "config.max_new_tokens" and "context of 1024 tokens" in error["message"]

    long_row = '{"prompt": "' + "word " * 1100 + '", "item": {"answer": "a"}}\n'
    task_set = services.task_set_create(
        project=alpha_setup.project, name="long", jsonl=long_row + '{"prompt": "hi", "item": {}}\n'
    )
    body = {**_run_body(alpha_setup, max_new_tokens=8), "task_set": task_set.pk}
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "config.max_new_tokens" and "task row 0" in error["message"]
    assert "context of 1024 tokens" in error["message"]
    ok = key_client.post("/api/v1/runs/", _run_body(alpha_setup, max_new_tokens=64), format="json")
    assert ok.status_code == 201, ok.json()


def test_a_run_without_a_learning_rate_gets_the_default_for_its_base_models_width(
    alpha_setup, key_client, tiny_model_dir, tmp_path
):
    import json
    import shutil

    from training.recipes.schedules import default_learning_rate

    # The tiny model's files, its config.json saying a 2048-wide model (read, never loaded here).
    wide = tmp_path / "wide"
    shutil.copytree(tiny_model_dir, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 2048}))
    services.base_model_register(name=alpha_setup.model.base_model.name, source=str(wide))

    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup), format="json")
    assert response.status_code == 201, response.json()
    run = response.json()
    assert run["config"]["learning_rate"] == default_learning_rate(2048) == pytest.approx(3.7e-4)
    assert (run["config"]["lr_schedule"], run["config"]["num_minibatches"]) == ("cosine", 2)
    events = key_client.get(f"/api/v1/runs/{run['id']}/events/").json()["data"]
    assert "learning rate 0.00037, the grpo default for a base model of width 2048" in events[0]["message"]
    services.run_cancel(run=Run.objects.get(pk=run["id"]))

    # A rate the caller sets is kept, and said nowhere as a default.
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, learning_rate=3e-4), format="json")
    assert response.status_code == 201 and response.json()["config"]["learning_rate"] == 3e-4
    events = key_client.get(f"/api/v1/runs/{response.json()['id']}/events/").json()["data"]
    assert "learning rate" not in events[0]["message"]


def test_sft_and_dpo_runs_need_rows_with_their_targets(alpha_setup, key_client, cast):
    response = key_client.post("/api/v1/runs/", {**_run_body(alpha_setup), "kind": "ppo"}, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "kind"
    response = key_client.post("/api/v1/runs/", {**_run_body(alpha_setup), "kind": "sft"}, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "task_set"
    assert "completion" in error_of(response)["message"]
    rows = [
        {"prompt": "q", "completion": "a"},
        {"prompt": "r", "chosen": "x", "rejected": {"role": "assistant", "content": "y"}},
    ]
    targets = services.task_set_create(project=alpha_setup.project, name="targets", rows=rows)
    body = {**_run_body(alpha_setup), "task_set": targets.pk}
    response = key_client.post("/api/v1/runs/", {**body, "kind": "dpo"}, format="json")
    assert response.status_code == 400 and "task row 0" in error_of(response)["message"]
    response = key_client.post("/api/v1/runs/", {**body, "kind": "sft"}, format="json")
    assert response.status_code == 400 and "task row 1" in error_of(response)["message"]
    sft_only = services.task_set_create(project=alpha_setup.project, name="sft", rows=rows[:1])
    response = key_client.post(
        "/api/v1/runs/", {**body, "task_set": sft_only.pk, "kind": "sft"}, format="json"
    )
    assert response.status_code == 201 and response.json()["kind"] == "sft"


def test_task_rows_with_malformed_targets_are_refused_naming_the_field(alpha_setup, key_client):
    for row, field in (
        ({"prompt": "q", "completion": 3}, "completion"),
        ({"prompt": "q", "chosen": "a"}, "rejected"),
        ({"prompt": "q", "chosen": {"role": "user", "content": "a"}, "rejected": "b"}, "chosen"),
    ):
        body = {"project": alpha_setup.project.pk, "name": f"bad-{field}", "rows": [row]}
        response = key_client.post("/api/v1/task-sets/", body, format="json")
        assert response.status_code == 400 and field in error_of(response)["message"], response.json()


def test_devices_and_overlap_are_checked_and_only_grpo_runs_overlap(alpha_setup, key_client):
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, devices=0), format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "config.devices"
    rows = [{"prompt": "q", "completion": "a"}]
    targets = services.task_set_create(project=alpha_setup.project, name="sft-devices", rows=rows)
    body = {**_run_body(alpha_setup, max_off_policy_steps=1), "task_set": targets.pk, "kind": "sft"}
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 400 and error_of(response)["param"] == "config.max_off_policy_steps"
    assert "GRPO runs only" in error_of(response)["message"]
    response = key_client.post(
        "/api/v1/runs/", _run_body(alpha_setup, max_off_policy_steps=17), format="json"
    )
    assert response.status_code == 400 and error_of(response)["param"] == "config.max_off_policy_steps"
    # Rollouts on the inference servers: only for an overlapped run, and only where it names a place.
    for config, reason in (({"rollouts_on": "inference_servers"}, "needs max_off_policy_steps"),
                           ({"rollouts_on": "gpu", "max_off_policy_steps": 1}, "must be one of worker, inference_servers")):  # fmt: skip
        response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, **config), format="json")
        assert response.status_code == 400 and error_of(response)["param"] == "config.rollouts_on", (
            response.json()
        )
        assert reason in error_of(response)["message"]
    response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, devices=2), format="json")
    assert response.status_code == 201 and response.json()["config"]["devices"] == 2
    services.run_cancel(run=Run.objects.get(pk=response.json()["id"]))
    # SFT and DPO runs take devices too (every session primitive mirrored on each rank), and fsdp
    # with them (no sampler setting needed: their held-out grading has a copy of its own).
    body = {**_run_body(alpha_setup, devices=2), "task_set": targets.pk, "kind": "sft"}
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201 and response.json()["config"]["devices"] == 2
    services.run_cancel(run=Run.objects.get(pk=response.json()["id"]))
    body = {**_run_body(alpha_setup, devices=2, fsdp=True), "task_set": targets.pk, "kind": "sft"}
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201 and response.json()["config"]["fsdp"] is True, response.json()


def test_a_sharded_base_is_a_grpo_run_setting_with_several_devices_and_a_sampler_of_its_own(
    alpha_setup, key_client
):
    for config, reason in (({"fsdp": True}, "needs devices of 2 or more"),
                           ({"fsdp": True, "devices": 2}, "needs max_off_policy_steps of 1 or more"),
                           ({"fsdp": "yes", "devices": 2, "max_off_policy_steps": 1}, "expected a boolean")):  # fmt: skip
        response = key_client.post("/api/v1/runs/", _run_body(alpha_setup, **config), format="json")
        assert response.status_code == 400 and error_of(response)["param"] == "config.fsdp", response.json()
        assert reason in error_of(response)["message"]
    body = _run_body(alpha_setup, fsdp=True, devices=2, max_off_policy_steps=1)
    response = key_client.post("/api/v1/runs/", body, format="json")
    assert response.status_code == 201 and response.json()["config"]["fsdp"] is True
    services.run_cancel(run=Run.objects.get(pk=response.json()["id"]))
