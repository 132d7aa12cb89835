"""A schedule of steps over stored completions ends as a whole (issue 55 follow-up,
projects.services.training_jobs): a step that fails cancels the schedule's later steps in the same
transaction (they would train on a checkpoint the schedule did not plan), leaving other schedules
and other models alone; a schedule is cancelled as a whole, a running step included, idempotently;
``/api/v1/stored-completions/train/{id}`` and ``.../cancel`` answer the schedule, team-scoped. No
step trains here: the failures and the claims are the services' own."""

from __future__ import annotations

import itertools

import pytest

from projects import services
from projects.models import RunEvent, TrainingJob, TrainingJobEvent, TrainingJobStatus
from projects.services.completion_training import training_schedule_status
from projects.services.training_jobs import training_schedule_cancel
from tests.projects.jobs.test_completion_schedule import URL
from tests.projects.jobs.test_training_jobs import (  # noqa: F401  (fixtures)
    enqueued,
    stored_completion,
    upload,
    world,
)

pytestmark = pytest.mark.django_db
_serial = itertools.count()


def rated_prompts(world, cast, prompts: int) -> list:  # noqa: F811
    """Per prompt a good (1) and a bad (0) completion, new ones on every call (one group each)."""
    rows = []
    for _ in range(prompts):
        index = next(_serial)
        messages = [{"role": "user", "content": f"Say {index}"}]
        rows.append(stored_completion(world, cast, f"c{index}-good", messages, f"{index}", reward=1.0))
        rows.append(stored_completion(world, cast, f"c{index}-bad", messages, "no", reward=0.0))
    return rows


def schedule_of(world, cast, steps: int) -> list[TrainingJob]:  # noqa: F811
    scheduled, _ = services.training_schedule_from_completions(
        model=world.model, completions=rated_prompts(world, cast, steps), schedule={"steps": steps}
    )
    return [step.job for step in scheduled]


def fresh(jobs: list[TrainingJob]) -> list[TrainingJob]:
    return [TrainingJob.objects.get(pk=job.pk) for job in jobs]


def failed_events(job: TrainingJob) -> list[str]:
    return list(
        TrainingJobEvent.objects.filter(job=job, type="training_failed").values_list("message", flat=True)
    )


@pytest.fixture
def other_models_job(world, cast):  # noqa: F811
    """A queued job of another model of the team: no schedule's business."""
    model, _ = services.client_model_register(
        team=cast.alpha, entity=None, project="math", name="other", base_model="tiny"
    )
    return services.training_job_create(
        model=model, trajectory_groups=upload(world, 1.0, 0.0, model_id="math/other:0")
    )


def test_a_schedule_names_its_first_job_on_every_step(world, cast):  # noqa: F811
    jobs = schedule_of(world, cast, 3)
    assert [job.schedule_id for job in fresh(jobs)] == [jobs[0].pk] * 3
    alone, _ = services.training_job_from_completions(
        model=world.model, completions=rated_prompts(world, cast, 1)
    )
    assert alone.schedule_id is None  # one step is no schedule
    assert training_schedule_status(fresh(jobs)) == "queued"


def test_a_failed_step_cancels_the_later_steps_of_its_schedule_only(
    world,  # noqa: F811
    cast,
    enqueued,  # noqa: F811
    other_models_job,
):
    first, second, third = schedule_of(world, cast, 3)
    other_schedule = schedule_of(world, cast, 2)
    TrainingJob.objects.filter(pk=first.pk).update(status=TrainingJobStatus.SUCCEEDED)  # step 1 trained
    assert services.training_job_claim(job_id=second.pk, worker="w") is not None

    assert services.training_job_fail(job_id=second.pk, worker="w", error="out of memory") is not None

    first, second, third = fresh([first, second, third])
    assert second.status == third.status == TrainingJobStatus.FAILED and second.error == "out of memory"
    reason = "cancelled: step 2 of this schedule failed: out of memory"
    assert third.error == reason and third.finished_at is not None
    assert failed_events(third) == [f"Training failed: {reason}"]  # what ART's client raises
    assert RunEvent.objects.filter(
        run=world.run, message=f"Training job {third.pk} failed: {reason}"
    ).exists()
    assert first.status == TrainingJobStatus.SUCCEEDED  # what trained stays trained
    assert training_schedule_status([first, second, third]) == "failed"
    # Another schedule of the same model and another model's job are untouched; the model's next
    # queued job (the other schedule's first) is enqueued.
    assert {job.status for job in fresh([*other_schedule, other_models_job])} == {TrainingJobStatus.QUEUED}
    assert enqueued[-1] == other_schedule[0].pk
    # Failing a cancelled step again is a no-op, and so is the first step's failure of a job alone.
    assert services.training_job_fail(job_id=third.pk, error="again") is None
    assert failed_events(third) == [f"Training failed: {reason}"]


def test_a_first_step_that_fails_before_it_starts_cancels_every_later_step(world, cast):  # noqa: F811
    jobs = schedule_of(world, cast, 3)
    services.training_job_fail(job_id=jobs[0].pk, error="no worker serves this base model")
    jobs = fresh(jobs)
    assert [job.error for job in jobs[1:]] == ["cancelled: step 1 of this schedule failed: no worker serves "
                                               "this base model"] * 2  # fmt: skip


def test_cancelling_a_schedule_ends_its_unfinished_steps_once(
    world,  # noqa: F811
    cast,
    enqueued,  # noqa: F811
    other_models_job,
):
    jobs = schedule_of(world, cast, 3)
    other_schedule = schedule_of(world, cast, 2)
    assert services.training_job_claim(job_id=jobs[0].pk, worker="w") is not None
    assert training_schedule_status(fresh(jobs)) == "running"

    cancelled = training_schedule_cancel(schedule=jobs[0])

    assert [job.pk for job in cancelled] == [job.pk for job in jobs]
    reason = f"cancelled: training schedule {jobs[0].pk} was cancelled"
    assert [(job.status, job.error) for job in cancelled] == [(TrainingJobStatus.FAILED, reason)] * 3
    assert all(failed_events(job) == [f"Training failed: {reason}"] for job in cancelled)
    # The running step's worker loses it: its heartbeat is refused, so its step is never recorded.
    assert services.training_job_heartbeat(job_id=jobs[0].pk, worker="w") is False
    assert training_schedule_status(cancelled) == "cancelled"
    assert {job.status for job in fresh([*other_schedule, other_models_job])} == {TrainingJobStatus.QUEUED}
    assert enqueued[-1] == other_schedule[0].pk

    events = TrainingJobEvent.objects.count()
    again = training_schedule_cancel(schedule=jobs[0])  # idempotent: nothing left to cancel
    assert [(job.pk, job.status, job.error) for job in again] == [
        (job.pk, job.status, job.error) for job in cancelled
    ]
    assert TrainingJobEvent.objects.count() == events


def test_cancelling_a_finished_schedule_changes_nothing(world, cast):  # noqa: F811
    jobs = schedule_of(world, cast, 2)
    TrainingJob.objects.filter(pk__in=[job.pk for job in jobs]).update(status=TrainingJobStatus.SUCCEEDED)
    assert training_schedule_status(training_schedule_cancel(schedule=jobs[0])) == "succeeded"
    assert not TrainingJobEvent.objects.filter(type="training_failed").exists()


def test_the_schedule_endpoints_answer_the_schedule_for_its_team_only(
    world,  # noqa: F811
    cast,
    key_client,
    read_only_client,
    bob_client,
    charlie_client,
):
    ids = [row.completion_id for row in rated_prompts(world, cast, 3)]
    reply = key_client.post(URL, {"model": world.model.pk, "completion_ids": ids, "schedule": {"steps": 3}},
                            format="json")  # fmt: skip
    assert reply.status_code == 201, reply.content
    created = reply.json()
    schedule_id = created["id"]
    assert created["object"] == "training_schedule" and created["jobs"][0] == schedule_id
    assert created["status"] == "queued" and created["statuses"] == ["queued"] * 3
    assert created["groups_per_step"] == [1, 1, 1] and created["counts"]["used"] == 6
    followed = key_client.get(f"{URL}/{schedule_id}").json()
    assert followed == {
        key: value for key, value in created.items() if key not in ("groups_per_step", "counts")
    }

    # Tenancy: another team's caller gets 404, a viewer or a read-only key cannot cancel, and a
    # later step's job id is no schedule's.
    cancel = f"{URL}/{schedule_id}/cancel"
    assert charlie_client.get(f"{URL}/{schedule_id}").status_code == 404
    assert charlie_client.post(cancel, {}, format="json").status_code == 404
    assert bob_client.post(cancel, {}, format="json").status_code == 403
    assert read_only_client.post(cancel, {}, format="json").status_code == 403
    assert key_client.post(f"{URL}/{created['jobs'][1]}/cancel", {}, format="json").status_code == 404
    assert key_client.post(cancel, {"now": True}, format="json").status_code == 400  # no body to give
    assert set(TrainingJob.objects.values_list("status", flat=True)) == {TrainingJobStatus.QUEUED}

    reply = key_client.post(cancel, {}, format="json")
    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert body["id"] == schedule_id and body["status"] == "cancelled" and body["statuses"] == ["failed"] * 3
    assert body["learning_rates"] == created["learning_rates"]
    assert key_client.post(cancel, format="json").json() == body  # again: the same answer
    assert key_client.get(f"{URL}/{schedule_id}/").json() == body
