"""Services: the run state machine, idempotent claims, exactly-once step records, orphan recovery."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from projects import services
from projects.errors import Conflict, InvalidTransition, ValidationFailed
from projects.models import Checkpoint, Run, RunEvent, RunStatus, StepMetrics, TaskRow
from projects.services.task_sets import parse_rows

pytestmark = pytest.mark.django_db


def make_run(setup, **config) -> Run:
    return services.run_create(
        model=setup.model, task_set=setup.task_set, environment=setup.environment, reward=setup.reward,
        config={"steps": 3, **config},
    )  # fmt: skip


def record(step: int, worker: str, run: Run) -> bool:
    return services.step_record(
        run=run, worker=worker, step=step, metrics={"reward_mean": 0.5, "loss": 0.1}, trajectories=[],
        checkpoint_path=f"/ckpt/{step}",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("start", "target", "allowed"),
    [
        (RunStatus.QUEUED, RunStatus.RUNNING, True),
        (RunStatus.QUEUED, RunStatus.SUCCEEDED, False),
        (RunStatus.RUNNING, RunStatus.SUCCEEDED, True),
        (RunStatus.RUNNING, RunStatus.QUEUED, False),
        (RunStatus.SUCCEEDED, RunStatus.RUNNING, False),
        (RunStatus.FAILED, RunStatus.CANCELLED, False),
        (RunStatus.CANCELLED, RunStatus.RUNNING, False),
        (RunStatus.PAUSED, RunStatus.QUEUED, True),
    ],
)
def test_transition_table_is_enforced_and_recorded(alpha_setup, start, target, allowed):
    run = make_run(alpha_setup)
    Run.objects.filter(pk=run.pk).update(status=start)
    events_before = RunEvent.objects.filter(run=run).count()
    if allowed:
        updated = services.run_transition(run_id=run.pk, to=target, message="go")
        assert updated.status == target
        event = RunEvent.objects.filter(run=run).last()
        assert event.data == {"from": start, "to": target}
        assert RunEvent.objects.filter(run=run).count() == events_before + 1
    else:
        with pytest.raises(InvalidTransition):
            services.run_transition(run_id=run.pk, to=target, message="go")
        run.refresh_from_db()
        assert run.status == start
        assert RunEvent.objects.filter(run=run).count() == events_before


def test_terminal_transitions_set_finished_at(alpha_setup):
    run = make_run(alpha_setup)
    services.run_claim(run_id=run.pk, worker="w")
    done = services.run_transition(run_id=run.pk, to=RunStatus.SUCCEEDED, message="ok")
    assert done.finished_at is not None and done.started_at is not None


def test_claim_is_idempotent(alpha_setup):
    run = make_run(alpha_setup)
    first = services.run_claim(run_id=run.pk, worker="w1")
    assert first is not None and first.status == RunStatus.RUNNING and first.attempts == 1
    assert services.run_claim(run_id=run.pk, worker="w1") is None  # duplicate delivery
    assert services.run_claim(run_id=run.pk, worker="w2") is None  # a live owner keeps it
    assert services.run_claim(run_id=run.pk + 1000, worker="w2") is None  # deleted/unknown run


def test_stale_run_is_reclaimed_by_another_worker(alpha_setup):
    run = make_run(alpha_setup)
    services.run_claim(run_id=run.pk, worker="w1")
    Run.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=600))
    taken = services.run_claim(run_id=run.pk, worker="w2", stale_after_s=300)
    assert taken is not None and taken.worker == "w2" and taken.attempts == 2
    assert not services.run_heartbeat(run_id=run.pk, worker="w1"), "the old worker must learn it lost the run"
    assert services.run_heartbeat(run_id=run.pk, worker="w2")
    assert "resuming" in RunEvent.objects.filter(run=run).last().message


def test_step_is_recorded_exactly_once_and_only_by_the_owner(alpha_setup):
    run = make_run(alpha_setup)
    run = services.run_claim(run_id=run.pk, worker="w1")
    assert record(1, "w1", run)
    assert not record(1, "w1", run), "a replayed step must be a no-op"
    assert not record(2, "intruder", run), "a worker that lost the run must not write"
    assert StepMetrics.objects.filter(run=run).count() == 1
    assert list(Checkpoint.objects.filter(model=alpha_setup.model).values_list("step", flat=True)) == [1]
    run.refresh_from_db()
    assert run.current_step == 1


def test_cancel_running_run_sets_flag_then_worker_finishes_it(alpha_setup):
    run = make_run(alpha_setup)
    services.run_claim(run_id=run.pk, worker="w1")
    requested = services.run_cancel(run=run)
    assert requested.status == RunStatus.RUNNING and requested.cancel_requested
    services.run_cancel(run=run)  # asking twice is harmless
    assert RunEvent.objects.filter(run=run, message__startswith="Cancellation requested").count() == 1


def test_cancelled_queued_run_is_not_claimed(alpha_setup):
    run = make_run(alpha_setup)
    services.run_cancel(run=run)
    assert services.run_claim(run_id=run.pk, worker="w1") is None


def test_run_fail_keeps_recorded_steps_and_stores_message(alpha_setup):
    run = services.run_claim(run_id=make_run(alpha_setup).pk, worker="w1")
    record(1, "w1", run)
    failed = services.run_fail(run_id=run.pk, error="ValueError: boom")
    assert failed.status == RunStatus.FAILED and failed.error == "ValueError: boom"
    assert StepMetrics.objects.filter(run=run).count() == 1
    assert services.run_fail(run_id=run.pk, error="again") is None  # already terminal


def test_requeue_orphaned_finds_only_stale_running_runs(alpha_setup, django_capture_on_commit_callbacks):
    run = services.run_claim(run_id=make_run(alpha_setup).pk, worker="w1")
    assert services.runs_requeue_orphaned(stale_after_s=60) == []
    Run.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=120))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert services.runs_requeue_orphaned(stale_after_s=60) == [run.pk]
    assert len(callbacks) == 1


def test_model_with_active_run_rejects_another(alpha_setup):
    make_run(alpha_setup)
    with pytest.raises(Conflict):
        make_run(alpha_setup)


def test_run_config_defaults_are_filled_in(alpha_setup):
    run = make_run(alpha_setup)
    assert run.config["steps"] == 3 and "learning_rate" in run.config and run.total_steps == 3


def test_environment_sampling_defaults_feed_the_run_config(alpha_setup):
    services.environment_update(
        environment=alpha_setup.environment, sampling={"temperature": 0.7, "stop": ["\n"]}
    )
    run = make_run(alpha_setup)
    assert run.config["temperature"] == 0.7
    override = Run.objects.get(pk=run.pk)
    services.run_cancel(run=override)
    assert make_run(alpha_setup, temperature=0.9).config["temperature"] == 0.9


def test_task_set_split_is_deterministic(alpha_setup):
    a = services.task_set_create(
        project=alpha_setup.project,
        name="a",
        rows=[{"prompt": str(i)} for i in range(20)],
        validation_fraction=0.25,
    )
    b = services.task_set_create(
        project=alpha_setup.project,
        name="b",
        rows=[{"prompt": str(i)} for i in range(20)],
        validation_fraction=0.25,
    )
    assert a.validation_count == 5 and a.train_count == 15
    splits_a = list(TaskRow.objects.filter(task_set=a).values_list("split", flat=True))
    splits_b = list(TaskRow.objects.filter(task_set=b).values_list("split", flat=True))
    assert splits_a == splits_b


def test_parse_rows_reports_every_bad_line():
    with pytest.raises(ValidationFailed) as caught:
        parse_rows(jsonl='{"prompt": "a"}\nnot json\n{"prompt": ""}\n[1]\n{"prompt": "x", "extra": 1}')
    where = [p[0] for p in caught.value.problems]
    assert where == ["line 2", "line 3: prompt", "line 4", "line 5: extra"]


def test_empty_task_set_is_rejected():
    with pytest.raises(ValidationFailed, match="no rows"):
        parse_rows(jsonl="\n\n")


def test_only_validation_rows_is_rejected(alpha_setup):
    with pytest.raises(ValidationFailed, match="training row"):
        services.task_set_create(
            project=alpha_setup.project, name="v", rows=[{"prompt": "a", "split": "validation"}]
        )


def test_api_key_authenticate_rejects_tampered_keys(cast):
    created = services.api_key_create(team=cast.alpha, name="k")
    assert services.api_key_authenticate(raw=created.plaintext).pk == created.api_key.pk
    assert services.api_key_authenticate(raw=created.plaintext + "x") is None
    assert services.api_key_authenticate(raw="garbage") is None
    services.api_key_revoke(api_key=created.api_key)
    assert services.api_key_authenticate(raw=created.plaintext) is None


def test_nul_characters_sampled_by_a_model_are_stored(alpha_setup):
    run = services.run_claim(run_id=make_run(alpha_setup).pk, worker="w1")
    trajectory = services.TrajectoryRecord(
        group_index=0, sample_index=0, task_row_index=0, messages=[{"role": "assistant", "content": "a\x00b"}],
        reward=0.0, sub_rewards={}, errors=[{"detail": "\x00"}], metrics={}, prompt_tokens=1, completion_tokens=2,
        finish_reason="length",
    )  # fmt: skip
    assert services.step_record(
        run=run, worker="w1", step=1, metrics={}, trajectories=[trajectory], checkpoint_path="/c"
    )
    stored = run.trajectories.get()
    assert stored.messages[0]["content"] == "a\ufffdb"
