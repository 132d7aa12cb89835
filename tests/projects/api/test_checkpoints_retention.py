"""Checkpoint retention and deletion: ``DELETE /api/v1/checkpoints/{id}``, ``POST
/api/v1/models/{id}/checkpoints/prune``, a model's retention policy after every step, optimizer
state kept only on each run's latest checkpoint, files removed after commit through the store
(listed before and after), disk used per model in the API; a prune racing a step on PostgreSQL."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from django.db import connection, transaction

from projects import selectors, services, storage
from projects.models import Checkpoint, Evaluation, Run, RunStatus
from projects.services.checkpoints import RESUME_STATE_FILES
from tests import factories
from tests.conftest import error_of

CHECKPOINTS = "/api/v1/checkpoints"
ADAPTER_BYTES = 3000
STATE_BYTES = 7000  # optimizer moments are twice the adapter and more: the point of dropping them


@pytest.fixture
def store_root(settings, tmp_path: Path) -> Path:
    settings.CHECKPOINT_DIR = tmp_path / "checkpoints"
    return settings.CHECKPOINT_DIR


def write_folder(root: Path, model_id: int, step: int) -> Path:
    """A checkpoint folder shaped like Policy.save_checkpoint's: adapter, optimizer, RNG, state."""
    folder = root / f"model-{model_id}" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"a" * ADAPTER_BYTES)
    (folder / "adapter_config.json").write_text("{}")
    (folder / "optimizer.pt").write_bytes(b"o" * STATE_BYTES)
    (folder / "rng_state.pt").write_bytes(b"r" * 100)
    (folder / "state.json").write_text("{}")
    return folder


def record(model, run, step: int, root: Path, **metrics) -> Checkpoint:
    folder = write_folder(root, model.pk, step)
    return services.checkpoint_record(model=model, run=run, step=step, path=str(folder), metrics=metrics)


def keys(model) -> list[str]:
    return storage.checkpoint_store().list_keys(f"model-{model.pk}/")


def steps_of(model) -> list[int]:
    return list(Checkpoint.objects.filter(model=model).order_by("step").values_list("step", flat=True))


@pytest.fixture
def model_with_steps(alpha_setup, store_root):
    """Checkpoints 0..3 of alpha's model (no run uses them)."""
    for step in range(4):
        record(alpha_setup.model, None, step, store_root)
    return alpha_setup.model


def finished_run(setup) -> Run:
    run = factories.RunFactory(
        model=setup.model,
        task_set=setup.task_set,
        environment=setup.environment,
        reward=setup.reward,
    )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
    return run


def evaluation_of(
    setup, checkpoint: Checkpoint, *, status: str, mean_reward: float | None = None
) -> Evaluation:
    return Evaluation.objects.create(
        project=setup.project,
        checkpoint=checkpoint,
        task_set=setup.task_set,
        environment=setup.environment,
        reward=setup.reward,
        status=status,
        results={} if mean_reward is None else {"mean_reward": mean_reward},
    )


# --- DELETE /checkpoints/{id} -----------------------------------------------------------------


def test_deleting_a_checkpoint_removes_its_folder_after_commit(
    model_with_steps, alice_client, django_capture_on_commit_callbacks
):
    model = model_with_steps
    target = Checkpoint.objects.get(model=model, step=1)
    before = keys(model)
    assert f"model-{model.pk}/step-000001" in before
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = alice_client.delete(f"{CHECKPOINTS}/{target.pk}")
        assert response.status_code == 204
        assert f"model-{model.pk}/step-000001" in keys(model)  # rows first, files after commit
    for callback in callbacks:
        callback()
    assert keys(model) == [key for key in before if not key.endswith("step-000001")]
    assert steps_of(model) == [0, 2, 3]
    assert alice_client.get(f"{CHECKPOINTS}/{target.pk}").status_code == 404


def test_the_latest_checkpoint_is_never_deleted(model_with_steps, alice_client):
    latest = Checkpoint.objects.get(model=model_with_steps, step=3)
    response = alice_client.delete(f"{CHECKPOINTS}/{latest.pk}")
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "checkpoint_in_use" and "latest" in error["message"]
    assert steps_of(model_with_steps) == [0, 1, 2, 3]


def test_a_checkpoint_an_evaluation_reads_is_409_naming_the_evaluation(
    alpha_setup, model_with_steps, alice_client
):
    checkpoint = Checkpoint.objects.get(model=model_with_steps, step=1)
    evaluation = evaluation_of(alpha_setup, checkpoint, status="running")
    response = alice_client.delete(f"{CHECKPOINTS}/{checkpoint.pk}")
    assert response.status_code == 409
    assert f"evaluation {evaluation.pk} (running)" in error_of(response)["message"]
    Evaluation.objects.filter(pk=evaluation.pk).update(status="succeeded")
    assert alice_client.delete(f"{CHECKPOINTS}/{checkpoint.pk}").status_code == 204


def test_an_active_runs_start_step_is_409_naming_the_run(alpha_setup, model_with_steps, alice_client):
    run = factories.RunFactory(
        model=model_with_steps,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    Run.objects.filter(pk=run.pk).update(start_step=0, current_step=0)  # queued, to start at step 0
    step_zero = Checkpoint.objects.get(model=model_with_steps, step=0)
    response = alice_client.delete(f"{CHECKPOINTS}/{step_zero.pk}")
    assert response.status_code == 409 and f"run #{run.pk} (queued)" in error_of(response)["message"]


def test_the_checkpoints_an_overlapped_run_would_sample_again_are_409(
    alpha_setup, model_with_steps, alice_client
):
    run = finished_run(alpha_setup)  # made running below, as a worker resuming it would find it
    Run.objects.filter(pk=run.pk).update(
        start_step=0,
        current_step=3,
        status=RunStatus.RUNNING,
        config={**run.config, "max_off_policy_steps": 1},
    )
    by_step = {c.step: c for c in Checkpoint.objects.filter(model=model_with_steps)}
    response = alice_client.delete(f"{CHECKPOINTS}/{by_step[2].pk}")  # step 3 resumes, sampled from step 2
    assert response.status_code == 409 and "samples it again if it resumes" in error_of(response)["message"]
    assert alice_client.delete(f"{CHECKPOINTS}/{by_step[1].pk}").status_code == 204  # outside the lag


def test_checkpoint_endpoints_outsider_404_viewer_403(
    model_with_steps, charlie_client, bob_client, read_only_client
):
    checkpoint = Checkpoint.objects.get(model=model_with_steps, step=1)
    prune = f"/api/v1/models/{model_with_steps.pk}/checkpoints/prune"
    assert charlie_client.get(f"{CHECKPOINTS}/{checkpoint.pk}").status_code == 404
    assert charlie_client.delete(f"{CHECKPOINTS}/{checkpoint.pk}").status_code == 404
    assert charlie_client.post(prune, {"keep_last": 1}, format="json").status_code == 404
    assert charlie_client.get(f"{CHECKPOINTS}/{checkpoint.pk}/adapter").status_code == 404
    for viewer in (bob_client, read_only_client):
        assert viewer.get(f"{CHECKPOINTS}/{checkpoint.pk}").status_code == 200
        assert error_of(viewer.delete(f"{CHECKPOINTS}/{checkpoint.pk}"))["code"] == "permission_denied"
        assert viewer.post(prune, {"keep_last": 1}, format="json").status_code == 403
    assert steps_of(model_with_steps) == [0, 1, 2, 3]


# --- prune ------------------------------------------------------------------------------------


def test_prune_keeps_the_last_n_the_best_k_and_what_is_in_use(
    alpha_setup, store_root, alice_client, django_capture_on_commit_callbacks
):
    model = alpha_setup.model
    checkpoints = [record(model, None, step, store_root) for step in range(7)]
    for step, reward in ((1, 0.9), (2, 0.1), (4, 0.5), (5, 0.2)):
        evaluation_of(alpha_setup, checkpoints[step], status="succeeded", mean_reward=reward)
    busy = evaluation_of(alpha_setup, checkpoints[3], status="queued")
    url = f"/api/v1/models/{model.pk}/checkpoints/prune"
    body = {"keep_last": 2, "keep_best": {"metric": "eval.mean_reward", "n": 2}}
    dry = alice_client.post(url, {**body, "dry_run": True}, format="json").json()
    assert dry["dry_run"] is True and dry["deleted_steps"] == [0, 2]
    assert steps_of(model) == list(range(7)) and len(keys(model)) == 7  # nothing changed
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_client.post(url, body, format="json")
    assert response.status_code == 200, response.json()
    result = response.json()
    # last 2: 5, 6; best 2 by eval.mean_reward: 1 (0.9), 4 (0.5); 3 is being evaluated.
    assert result["deleted_steps"] == [0, 2] and result["kept_steps"] == [1, 3, 4, 5, 6]
    assert result["in_use"] == [{"step": 3, "reason": f"evaluation {busy.pk} (queued) reads it"}]
    assert result["freed_bytes"] == dry["freed_bytes"] > 2 * ADAPTER_BYTES
    assert steps_of(model) == [1, 3, 4, 5, 6]
    assert keys(model) == [f"model-{model.pk}/step-{step:06d}" for step in (1, 3, 4, 5, 6)]


def test_prune_by_a_step_metric_lowest_first(alpha_setup, store_root, alice_client):
    model = alpha_setup.model
    for step, loss in enumerate([0.5, 0.1, 0.9, 0.3]):
        record(model, None, step, store_root, loss=loss)
    body = {"keep_best": {"metric": "loss", "n": 1, "mode": "min"}}
    result = alice_client.post(f"/api/v1/models/{model.pk}/checkpoints/prune", body, format="json").json()
    assert result["kept_steps"] == [1, 3] and result["deleted_steps"] == [0, 2]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "keep_last"),
        ({"keep_last": "two"}, "keep_last"),
        ({"keep_last": True}, "keep_last"),
        ({"keep_last": -1}, "keep_last"),
        ({"keep_first": 1}, "keep_first"),
        ({"keep_best": 3}, "keep_best"),
        ({"keep_best": {"metric": "eval.mean_reward"}}, "keep_best.n"),
        ({"keep_best": {"metric": "eval.mean_reward", "n": 0}}, "keep_best.n"),
        ({"keep_best": {"metric": "", "n": 1}}, "keep_best.metric"),
        ({"keep_best": {"metric": "loss", "n": 1, "mode": "up"}}, "keep_best.mode"),
        ({"keep_last": 1, "dry_run": "maybe"}, "dry_run"),
    ],
)
def test_bad_prune_input_is_400_naming_the_field(model_with_steps, alice_client, body, param):
    response = alice_client.post(
        f"/api/v1/models/{model_with_steps.pk}/checkpoints/prune", body, format="json"
    )
    assert response.status_code == 400, response.json()
    assert error_of(response)["param"] == param
    assert steps_of(model_with_steps) == [0, 1, 2, 3]


def test_bad_retention_policy_on_a_model_is_400_naming_the_field(model_with_steps, alice_client):
    response = alice_client.patch(
        f"/api/v1/models/{model_with_steps.pk}", {"retention": {"keep_last": "x"}}, format="json"
    )
    assert response.status_code == 400 and error_of(response)["param"] == "retention.keep_last"


# --- after every step -------------------------------------------------------------------------


def write_step(run: Run, step: int, root: Path) -> None:
    """What services.step_record does with the run's lock held (here without a worker)."""
    folder = write_folder(root, run.model_id, step)
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        services.steps.step_rows_write(
            run=locked, step=step, metrics={"reward_mean": step / 10}, trajectories=[], path=str(folder)
        )


def test_optimizer_state_stays_only_on_each_runs_latest_checkpoint(
    alpha_setup, store_root, django_capture_on_commit_callbacks
):
    model = alpha_setup.model
    first = finished_run(alpha_setup)
    with django_capture_on_commit_callbacks(execute=True):
        record(model, first, 0, store_root)
        for step in (1, 2):
            write_step(first, step, store_root)
    second = finished_run(alpha_setup)
    with django_capture_on_commit_callbacks(execute=True):
        for step in (3, 4):
            write_step(second, step, store_root)
    root = store_root / f"model-{model.pk}"
    with_state = sorted(p.parent.name for p in root.glob("*/optimizer.pt"))
    assert with_state == ["step-000002", "step-000004"]  # the latest of each run
    assert not list(root.glob("step-00000[013]/rng_state.pt"))
    assert len(list(root.glob("*/adapter_model.safetensors"))) == 5  # every adapter stays
    older = Checkpoint.objects.get(model=model, step=1)
    assert older.size_bytes == storage.folder_digest(root / "step-000001").size_bytes < ADAPTER_BYTES + 200
    assert set(RESUME_STATE_FILES) == {"optimizer.pt", "rng_state.pt"}


def test_a_worker_taking_a_run_over_settles_a_half_dropped_resume_state(
    alpha_setup, store_root, django_capture_on_commit_callbacks
):
    """A worker killed after a step dropped the previous checkpoint's resume state in the store but
    before it wrote the new digest to the row: the next worker's settle makes row and store agree."""
    model = alpha_setup.model
    run = finished_run(alpha_setup)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, start_step=0, current_step=0)
    with django_capture_on_commit_callbacks(execute=True):
        record(model, run, 0, store_root)
        write_step(run, 1, store_root)
    with django_capture_on_commit_callbacks(execute=False):  # killed: step 2's callbacks never ran
        write_step(run, 2, store_root)
    store = storage.checkpoint_store()
    step_1 = Checkpoint.objects.get(model=model, step=1)
    key = selectors.checkpoint_key(step_1)
    full = store.stat(key)  # the row as a stored checkpoint's: key, digest and size of its folder
    Checkpoint.objects.filter(pk=step_1.pk).update(
        storage_key=key, sha256=full.sha256, size_bytes=full.size_bytes
    )
    store.remove_files(key, RESUME_STATE_FILES)  # the half the killed worker did
    assert store.stat(key).sha256 != Checkpoint.objects.get(pk=step_1.pk).sha256  # names gone files

    Run.objects.filter(pk=run.pk).update(current_step=2)  # what step_record keeps (not step_rows_write)
    run.refresh_from_db()
    assert services.run_checkpoints_settle(run=run) == 2  # steps 0 and 1, not the one resumed from
    for step in (0, 1):
        settled = Checkpoint.objects.get(model=model, step=step)
        stored = store.stat(selectors.checkpoint_key(settled))
        assert stored.size_bytes == settled.size_bytes, step
        if settled.storage_key:  # (a row recorded without a key keeps no digest)
            assert stored.sha256 == settled.sha256, step
        assert settled.size_bytes < ADAPTER_BYTES + 200  # its resume state is gone
    latest = store_root / f"model-{model.pk}" / "step-000002"
    assert (latest / "optimizer.pt").is_file()  # the checkpoint the run resumes from keeps it
    assert services.run_checkpoints_settle(run=run) == 2  # idempotent


def test_a_models_retention_policy_runs_after_every_step(
    alpha_setup, store_root, alice_client, django_capture_on_commit_callbacks
):
    model = alpha_setup.model
    response = alice_client.patch(
        f"/api/v1/models/{model.pk}", {"retention": {"keep_last": 2}}, format="json"
    )
    assert response.status_code == 200 and response.json()["retention"] == {"keep_last": 2}
    run = factories.RunFactory(
        model=model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, start_step=0, current_step=0)
    with django_capture_on_commit_callbacks(execute=True):
        record(model, run, 0, store_root)
        for step in range(1, 6):
            write_step(run, step, store_root)
    # The last two, and step 0: the running run started there.
    assert steps_of(model) == [0, 4, 5]
    assert keys(model) == [f"model-{model.pk}/step-{step:06d}" for step in (0, 4, 5)]


# --- models and projects ----------------------------------------------------------------------


def test_storage_bytes_per_model_and_deleting_a_model_or_project_removes_its_files(
    alpha_setup, model_with_steps, store_root, alice_client, django_capture_on_commit_callbacks
):
    model = model_with_steps
    shown = alice_client.get(f"/api/v1/models/{model.pk}").json()["storage_bytes"]
    assert shown == sum(storage.folder_digest(store_root / key).size_bytes for key in keys(model)) > 0
    other = factories.TrainableModelFactory(
        project=alpha_setup.project, name="other", base_model=alpha_setup.base
    )
    record(other, None, 0, store_root)
    with django_capture_on_commit_callbacks(execute=True):
        assert alice_client.delete(f"/api/v1/models/{model.pk}").status_code == 204
    assert keys(model) == [] and not (store_root / f"model-{model.pk}").exists()
    assert keys(other) == [f"model-{other.pk}/step-000000"]
    assert selectors.project_storage_bytes(project=alpha_setup.project) > 0
    with django_capture_on_commit_callbacks(execute=True):
        assert alice_client.delete(f"/api/v1/projects/{alpha_setup.project.pk}").status_code == 204
    assert keys(other) == [] and not any(store_root.iterdir())


def test_a_refused_model_delete_keeps_its_files(
    alpha_setup, model_with_steps, alice_client, django_capture_on_commit_callbacks
):
    finished_run(alpha_setup)  # runs protect their model
    with django_capture_on_commit_callbacks(execute=True):
        assert alice_client.delete(f"/api/v1/models/{model_with_steps.pk}").status_code == 409
    assert len(keys(model_with_steps)) == 4


# --- the race ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_prune_waits_for_a_step_being_recorded_and_sees_it(alpha_setup, store_root):
    """On PostgreSQL: a step's writer holds its run's row lock; a prune (model, then active runs'
    locks) waits for it to commit and then counts the new step as the latest, so the step that
    was the latest when the prune began is pruned and the new one is kept, never the reverse."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's (SQLite serialises whole transactions)")
    model = alpha_setup.model
    run = factories.RunFactory(
        model=model,
        task_set=alpha_setup.task_set,
        environment=alpha_setup.environment,
        reward=alpha_setup.reward,
    )
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, start_step=0)
    record(model, run, 0, store_root)
    for step in (1, 2):
        write_step(run, step, store_root)
    step_written, times = threading.Event(), {}
    errors: list[BaseException] = []

    def recorder() -> None:
        try:
            folder = write_folder(store_root, model.pk, 3)
            with transaction.atomic():
                locked = Run.objects.select_for_update().get(pk=run.pk)
                services.steps.step_rows_write(
                    run=locked, step=3, metrics={}, trajectories=[], path=str(folder)
                )
                step_written.set()
                time.sleep(0.5)  # the prune arrives while this step is uncommitted
                times["committed"] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            connection.close()

    result: dict = {}

    def pruner() -> None:
        try:
            step_written.wait(5)
            result["prune"] = services.checkpoints_prune(model=model, policy={"keep_last": 1})
            times["pruned"] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=recorder), threading.Thread(target=pruner)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    assert times["pruned"] >= times["committed"]  # it waited for the step
    prune = result["prune"]
    assert prune.deleted == [1, 2] and 3 in prune.kept and 0 in prune.in_use
    assert steps_of(model) == [0, 3]


def test_the_dashboard_shows_the_disk_a_model_and_a_project_use(alpha_setup, model_with_steps, alice_client):
    from django.template.defaultfilters import filesizeformat

    size = filesizeformat(selectors.model_storage_bytes(model=model_with_steps))
    assert size != filesizeformat(0)
    model_page = alice_client.get(f"/models/{model_with_steps.pk}/").content.decode()
    assert f"Disk used: {size}" in model_page
    project_page = alice_client.get(f"/projects/{alpha_setup.project.pk}/").content.decode()
    assert f"{size} on disk" in project_page and project_page.count(size) >= 2
