"""Several training steps on captured traffic (issue 55's schedule,
projects.services.completion_training): the groups built once, cut into seeded batches over epochs,
a learning rate per step from the run recipes' schedule function, one training job per step queued
and trained in order, each with its rate and its lineage event; bad schedule values are a 400
naming ``schedule.<key>``; without a schedule the endpoint queues one job as before. The one-step
path's own tests are in test_training_jobs.py (whose fixtures these reuse)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from projects import services
from projects.jobs import claimed
from projects.jobs.training_jobs import TRAINING_JOB
from projects.models import Checkpoint, RunEvent, TrainingJob, TrainingJobEvent
from projects.services.completion_training import schedule_batches, training_schedule_check
from tests.conftest import error_of
from tests.projects.jobs.test_training_jobs import (  # noqa: F401  (fixtures)
    enqueued,
    stored_completion,
    world,
)
from training.config import TrainConfig
from training.recipes.art_config import art_job_config
from training.recipes.schedules import learning_rate_at

# Committed rows for the tests that train (the job's heartbeat thread reads them on its own
# connection); the schedule's arithmetic needs no database.
in_database = pytest.mark.django_db(transaction=True)
URL = "/api/v1/stored-completions/train"


def rated_prompts(world, cast, prompts: int) -> list:  # noqa: F811
    """Per prompt a good (1) and a bad (0) completion: ``prompts`` groups that can teach."""
    rows = []
    for index in range(prompts):
        messages = [{"role": "user", "content": f"Say {index}"}]
        rows.append(stored_completion(world, cast, f"c{index}-good", messages, f"{index}", reward=1.0))
        rows.append(stored_completion(world, cast, f"c{index}-bad", messages, "no", reward=0.0))
    return rows


def test_a_schedule_cuts_the_groups_into_batches_over_epochs_with_a_seeded_shuffle():
    batches = schedule_batches(groups=5, steps=3, epochs=2, groups_per_step=None, seed=7)
    assert [len(batch) for batch in batches] == [4, 3, 3]  # all 10 passes' groups, as even as can be
    order = [index for batch in batches for index in batch]
    assert sorted(order[:5]) == sorted(order[5:]) == [0, 1, 2, 3, 4]  # each epoch: every group once
    assert order[:5] != order[5:] or order[:5] != list(range(5))  # shuffled per epoch
    assert schedule_batches(groups=5, steps=3, epochs=2, groups_per_step=None, seed=7) == batches
    assert schedule_batches(groups=5, steps=3, epochs=2, groups_per_step=None, seed=8) != batches
    # A fixed size: what the steps do not reach of the last pass is left out.
    fixed = schedule_batches(groups=7, steps=3, epochs=1, groups_per_step=2, seed=0)
    assert [len(batch) for batch in fixed] == [2, 2, 2] and len({i for b in fixed for i in b}) == 6
    assert schedule_batches(groups=3, steps=3, epochs=1, groups_per_step=None, seed=0) in (
        [[a], [b], [c]] for a in range(3) for b in range(3) for c in range(3) if len({a, b, c}) == 3
    )
    with pytest.raises(ValueError):
        schedule_batches(groups=2, steps=3, epochs=1, groups_per_step=None, seed=0)


@pytest.mark.parametrize("shape", ["cosine", "linear", "constant"])
def test_learning_rates_follow_the_run_recipes_schedule_with_warm_up(shape):
    checked = training_schedule_check(
        {"steps": 6, "learning_rate": 1e-3, "lr_schedule": shape, "warmup_steps": 2}
    )
    recipe = TrainConfig(learning_rate=1e-3, lr_schedule=shape, warmup_steps=2)  # a run's floor, 0.1
    assert checked.rates == [learning_rate_at(recipe, step, 6) for step in range(1, 7)]
    assert checked.rates[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])  # warm-up, then the peak
    assert checked.rates[-1] == pytest.approx(1e-3 if shape == "constant" else 1e-4)
    if shape == "cosine":
        assert checked.rates[3] > 1e-3 * (1 - 1 / 3)  # a cosine stays above the line at first
    if shape == "linear":
        assert checked.rates[3] == pytest.approx(1e-3 - 0.9e-3 / 3)


def test_the_peak_defaults_to_the_rate_a_job_would_train_at():
    # One default: the one projects.services.training_jobs resolves for a job (art_job_config).
    default = art_job_config(None)[0].learning_rate
    assert training_schedule_check({"steps": 3}).rates == [default] * 3
    given = training_schedule_check({"steps": 2, "lr_schedule": "linear", "min_lr_ratio": 0.5},
                                    experimental_config={"learning_rate": 2e-4})  # fmt: skip
    assert given.rates == pytest.approx([2e-4, 1e-4])
    recipe = replace(art_job_config({"learning_rate": 2e-4})[0], lr_schedule="linear", warmup_steps=0,
                     min_lr_ratio=0.5)  # fmt: skip
    assert given.rates == [learning_rate_at(recipe, step, 2) for step in (1, 2)]


@in_database
def test_a_schedule_queues_one_job_per_step_trained_in_order_with_its_rate_and_lineage(
    world,  # noqa: F811
    cast,
    enqueued,  # noqa: F811
):
    rows = rated_prompts(world, cast, 3)
    schedule = {"steps": 3, "epochs": 2, "learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": 1,
                "seed": 5}  # fmt: skip
    steps, counts = services.training_schedule_from_completions(
        model=world.model, completions=rows, schedule=schedule, experimental_config={"loss_fn": "ppo"}
    )
    jobs = [step.job for step in steps]
    assert [job.pk for job in jobs] == sorted(job.pk for job in jobs) and enqueued == [job.pk for job in jobs]
    rates = training_schedule_check(schedule).rates
    assert len(set(rates)) == 3 and [step.learning_rate for step in steps] == rates
    assert [job.config["learning_rate"] for job in jobs] == rates  # through experimental_config
    assert all(job.config["loss_type"] == "ppo" for job in jobs)  # merged with the caller's
    batches = schedule_batches(groups=3, steps=3, epochs=2, groups_per_step=None, seed=5)
    assert [len(job.groups) for job in jobs] == [len(batch) for batch in batches] == [2, 2, 2]
    assert counts["groups"] == 3 and counts["groups_scheduled"] == 6 and counts["groups_unused"] == 0
    assert counts["used"] == 6 and counts["steps_without_signal"] == 0

    lineage = {
        event.data["training_job"]: event.data
        for event in RunEvent.objects.filter(run=world.run, data__has_key="schedule")
    }
    assert [lineage[job.pk]["schedule"]["step"] for job in jobs] == [1, 2, 3]
    assert [lineage[job.pk]["schedule"]["learning_rate"] for job in jobs] == rates
    for job, batch in zip(jobs, batches, strict=True):  # a step names the completions of its groups
        expected = {f"c{index}-{kind}" for index in batch for kind in ("good", "bad")}  # groups: prompt order
        assert set(lineage[job.pk]["stored_completions"]) == expected
        assert set(lineage[job.pk]["served_steps"].values()) == {0}

    # Each step waits for the one before, then trains on its checkpoint at its own rate.
    assert services.training_job_claim(job_id=jobs[1].pk, worker="w") is None
    for number, job in enumerate(jobs, start=1):
        assert claimed.work_on(TRAINING_JOB, job.pk) == "succeeded"
        job.refresh_from_db()
        assert job.step == number
        gradient = TrainingJobEvent.objects.get(job=job, type="gradient_step").data
        assert gradient["learning_rate"] == pytest.approx(rates[number - 1])
    steps_made = Checkpoint.objects.filter(model=world.model).order_by("step").values_list("step", flat=True)
    assert list(steps_made) == [0, 1, 2, 3]


@in_database
def test_bad_schedules_are_400s_naming_the_field_and_queue_nothing(world, cast, key_client):  # noqa: F811
    ids = [row.completion_id for row in rated_prompts(world, cast, 2)]
    base = {"model": world.model.pk, "completion_ids": ids}
    for schedule, field in [
        ("weekly", "schedule"),
        ({}, "schedule.steps"),
        ({"steps": 0}, "schedule.steps"),
        ({"steps": 1001}, "schedule.steps"),
        ({"steps": "2"}, "schedule.steps"),
        ({"steps": True}, "schedule.steps"),
        ({"steps": 3}, "schedule.steps"),  # 2 groups, one epoch: no group for a third step
        ({"steps": 2, "groups_per_step": 2}, "schedule.groups_per_step"),  # needs 4 of 2
        ({"steps": 2, "groups_per_step": 0}, "schedule.groups_per_step"),
        ({"steps": 2, "epochs": 0}, "schedule.epochs"),
        ({"steps": 2, "warmup_steps": 2}, "schedule.warmup_steps"),  # no step left at the peak
        ({"steps": 2, "lr_schedule": "step"}, "schedule.lr_schedule"),
        ({"steps": 2, "learning_rate": -1}, "schedule.learning_rate"),
        ({"steps": 2, "learning_rate": "fast"}, "schedule.learning_rate"),
        ({"steps": 2, "min_lr_ratio": 2}, "schedule.min_lr_ratio"),
        ({"steps": 2, "seed": -1}, "schedule.seed"),
        ({"steps": 2, "shuffle": False}, "schedule.shuffle"),
    ]:
        reply = key_client.post(URL, {**base, "schedule": schedule}, format="json")
        assert reply.status_code == 400 and error_of(reply)["param"] == field, (schedule, reply.content)
    reply = key_client.post(URL, {**base, "schedule": {"steps": 2, "learning_rate": 1e-4},
                                  "experimental_config": {"learning_rate": 1e-4}}, format="json")  # fmt: skip
    assert error_of(reply)["param"] == "schedule.learning_rate"  # the peak in one place
    reply = key_client.post(URL, {**base, "schedule": {"steps": 2}, "experimental_config": {"loss_fn": "x"}},
                            format="json")  # fmt: skip
    assert error_of(reply)["param"] == "experimental_config.loss_fn"
    assert not TrainingJob.objects.exists()


@in_database
def test_the_endpoint_answers_every_step_and_keeps_one_step_without_a_schedule(
    world,  # noqa: F811
    cast,
    key_client,
    read_only_client,
):
    ids = [row.completion_id for row in rated_prompts(world, cast, 3)]
    base = {"model": world.model.pk, "completion_ids": ids}
    one = key_client.post(URL, {**base, "schedule": None}, format="json").json()
    assert one["object"] == "training_job" and TrainingJob.objects.count() == 1
    assert set(one["counts"]) == {"given", "unrated", "other_model", "without_tokens", "used", "groups",
                                  "trajectories"}  # fmt: skip

    schedule = {"steps": 3, "learning_rate": 5e-4, "lr_schedule": "linear", "warmup_steps": 1, "seed": 1}
    reply = key_client.post(URL, {**base, "schedule": schedule}, format="json")
    assert reply.status_code == 201, reply.content
    body = reply.json()
    assert body["object"] == "training_schedule" and body["model"] == world.model.pk and body["steps"] == 3
    assert body["jobs"] == list(
        TrainingJob.objects.exclude(pk=one["id"]).order_by("pk").values_list("pk", flat=True)
    )
    assert body["learning_rates"] == training_schedule_check(schedule).rates
    assert body["groups_per_step"] == [1, 1, 1] and body["counts"]["used"] == 6
    for job_id, rate in zip(body["jobs"], body["learning_rates"], strict=True):
        assert TrainingJob.objects.get(pk=job_id).config["learning_rate"] == rate

    # Tenancy as without a schedule: another team's model is refused, a viewer cannot write.
    theirs = services.trainable_model_create(project=services.project_create(team=cast.beta, name="theirs"),
                                             name="m", base_model=world.model.base_model)  # fmt: skip
    reply = key_client.post(URL, {"model": theirs.pk, "completion_ids": ids, "schedule": {"steps": 1}},
                            format="json")  # fmt: skip
    assert reply.status_code == 400 and error_of(reply)["param"] == "model"
    assert read_only_client.post(URL, {**base, "schedule": {"steps": 1}}, format="json").status_code == 403
    assert TrainingJob.objects.count() == 4
