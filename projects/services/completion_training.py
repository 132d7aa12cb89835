"""Training a model on its rated stored completions (issue 55): the completions as ART trajectory
groups (``completion_groups``), one off-policy step on all of them
(``training_job_from_completions``), or a schedule of steps over them
(``training_schedule_from_completions``: batches, epochs, a learning rate per step).

Order invariant: a schedule's steps are training jobs of one model created in one transaction, in
step order, so their ids ascend with the step. projects.services.training_jobs claims a model's jobs
in id order only (a job waits while an earlier one of its model is unfinished; each that ends
enqueues the next), so step k + 1 trains on the checkpoint step k made. No other job of the model
falls between them: each creation locks the model row until the schedule's transaction commits.
A schedule is named by its first job (``TrainingJob.schedule``, on every step's job): a step that
fails or is cancelled cancels the later ones (projects.services.training_jobs.training_job_fail),
and ``training_schedule_cancel`` there cancels what is left of one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from django.db import transaction

from projects.errors import NotFound, ValidationFailed
from projects.models import StoredCompletion, TrainableModel, TrainingJob, TrainingJobStatus
from projects.services import conversations
from projects.services.client_models import UNFINISHED
from projects.services.runs import run_event_add
from projects.services.training_jobs import CANCELLED, training_job_config, training_job_create
from training.config import SEED_MAX, ConfigError
from training.recipes.schedules import learning_rate_at
from training.runs.art_tokens import sampled_step


@dataclass(frozen=True)
class CompletionGroup:
    """One prompt's trajectories (ART's group) and the completions they were built from."""

    trajectories: list[dict[str, Any]]
    rows: list[StoredCompletion]
    rewards: frozenset[float]

    @property
    def trainable(self) -> bool:
        """Two rewards to compare: GRPO learns from this group."""
        return len(self.rewards) > 1


@dataclass(frozen=True)
class CompletionGroups:
    groups: list[CompletionGroup]
    used: list[StoredCompletion]  # every completion the groups hold, in the order given
    counts: dict[str, int]


def completion_groups(*, model: TrainableModel, completions: list[StoredCompletion]) -> CompletionGroups:
    """The usable ``completions`` of ``model`` as trajectory groups (see
    ``training_job_from_completions`` for what is used); a 400 when no group can teach anything."""
    prefix = f"{model.project.name}/{model.name}:"
    counts = {"given": len(completions), "unrated": 0, "other_model": 0, "without_tokens": 0}
    kept: dict[str, list[StoredCompletion]] = {}  # by conversation (a row alone: by its own id)
    for row in completions:
        if row.team_id != model.project.team_id:
            raise NotFound("No chat completion found with that id.")
        if not (row.served_by.startswith(prefix) or row.served_by == model.base_model.name):
            counts["other_model"] += 1
        elif conversations.sampled(row) is None:
            counts["without_tokens"] += 1
        else:
            kept.setdefault(row.conversation_id or f"\x00{row.completion_id}", []).append(row)
    trajectories: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    members: dict[tuple[int, ...], list[StoredCompletion]] = {}
    rewards: dict[tuple[int, ...], set[float]] = {}
    for conversation, rows in list(kept.items()):
        rows.sort(key=lambda row: (row.created_at, row.pk))
        if rows[-1].reward is None:  # a conversation's reward is its newest turn's
            counts["unrated"] += len(rows)
            del kept[conversation]
            continue
        reward = float(rows[-1].reward)
        key = tuple(rows[0].prompt_token_ids or ())  # sampled() checked it is there
        trajectories.setdefault(key, []).append(conversations.conversation_trajectory(rows, reward))
        members.setdefault(key, []).extend(rows)
        rewards.setdefault(key, set()).add(reward)
    if not any(len(values) > 1 for values in rewards.values()):
        raise ValidationFailed(
            f"no prompt has two usable completions with different rewards (of {counts['given']}: "
            f"{counts['unrated']} unrated, {counts['other_model']} served by another model, "
            f"{counts['without_tokens']} stored without ids or logprobs)",
            field="completions",
        )
    groups = [
        CompletionGroup(trajectories[key], members[key], frozenset(rewards[key])) for key in trajectories
    ]
    used = [row for rows in kept.values() for row in rows]
    counts.update(used=len(used), groups=len(groups), trajectories=len(kept))
    return CompletionGroups(groups=groups, used=used, counts=counts)


def _lineage(job: TrainingJob, used: list[StoredCompletion], schedule: dict[str, Any] | None = None) -> None:
    """The run's event naming every completion the job trains on, with the step that served each."""
    served = {row.completion_id: sampled_step(row.served_by) or 0 for row in used}
    data: dict[str, Any] = {
        "training_job": job.pk,
        "stored_completions": list(served),
        "served_steps": served,
    }
    message = f"Training job {job.pk} trains on {len(used)} stored completions"
    if schedule is not None:
        data["schedule"] = schedule
        message += (
            f" (schedule step {schedule['step']} of {schedule['steps']}, "
            f"learning rate {schedule['learning_rate']:.3g})"
        )
    run_event_add(run=job.run, message=message, data=data)


def training_job_from_completions(
    *,
    model: TrainableModel,
    completions: list[StoredCompletion],
    experimental_config: Any = None,
    created_by: Any = None,
) -> tuple[TrainingJob, dict[str, int]]:
    """One training step of ``model`` on what its users saw: the stored completions as ART
    trajectory groups, trained off-policy on the exact ids the sampler gave and sampled and its
    logprobs, importance-weighted by ART's loss against the policy now
    (projects.services.training_jobs, training.runs.art_tokens). A conversation's turns among
    ``completions`` are one multi-turn trajectory (projects.services.conversations: joined on the
    sampler's ids, exact boundaries) with the reward of its newest turn; trajectories whose first
    prompt is the same are one group. Each choice names the checkpoint that served it, so the job
    measures how many steps stale each is (its ``off_policy_steps`` metrics); the run's event lists
    every completion used with the step that served it (lineage from the checkpoint this step
    makes back to the traffic).

    Used: completions of the model's team served by one of its checkpoints (or by its base model),
    rated (a conversation: its newest turn among them), with their ids and logprobs (a row stored
    without logprobs is left out). At least one
    group needs two trajectories with different rewards, or GRPO has nothing to learn from.
    ``experimental_config`` is ART's (learning rate, loss, clipping …), as for a client's job."""
    built = completion_groups(model=model, completions=completions)
    job = training_job_create(model=model, trajectory_groups=[{"trajectories": g.trajectories} for g in built.groups],
                              experimental_config=experimental_config, created_by=created_by)  # fmt: skip
    _lineage(job, built.used)
    return job, built.counts


# ----------------------------------------------------------------------------- schedules

MAX_SCHEDULE_STEPS = 1000
MAX_EPOCHS = 100
MAX_GROUPS_PER_STEP = 1024  # as a run's groups_per_step (training.config.TrainConfig)
SCHEDULE_KEYS = ("steps", "groups_per_step", "epochs", "learning_rate", "lr_schedule", "warmup_steps",
                 "min_lr_ratio", "seed")  # fmt: skip


@dataclass(frozen=True)
class TrainingSchedule:
    """A schedule as checked: ``rates`` holds each step's learning rate (training.recipes.schedules,
    the function a run's steps use), from ``learning_rate`` (the peak) over ``steps`` steps."""

    steps: int
    groups_per_step: int | None  # None: every pass's groups spread evenly over the steps
    epochs: int
    seed: int
    rates: list[float]


@dataclass(frozen=True)
class ScheduledStep:
    step: int
    job: TrainingJob
    learning_rate: float
    groups: int
    completions: int


def _whole(schedule: dict[str, Any], key: str, low: int, high: int) -> int | None:
    """``schedule[key]`` (None when left out or null), a whole number from ``low`` to ``high``."""
    value = schedule.get(key)
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high
    ):
        raise ValidationFailed(f"must be a whole number from {low} to {high}", field=f"schedule.{key}")
    return value


def training_schedule_check(schedule: Any, *, experimental_config: Any = None) -> TrainingSchedule:
    """The schedule's values checked (a 400 names ``schedule.<key>``) and its learning rates. The
    peak ``learning_rate`` defaults to the one a job with ``experimental_config`` trains at
    (projects.services.training_jobs.training_job_config); ``lr_schedule`` to ``constant`` (N steps
    at one rate: the endpoint called N times), ``warmup_steps`` to 0, ``min_lr_ratio`` (the floor of
    cosine and linear) to a run's, ``seed`` to 0."""
    if not isinstance(schedule, dict):
        raise ValidationFailed("must be an object", field="schedule")
    for key in schedule:
        if key not in SCHEDULE_KEYS:
            raise ValidationFailed(
                f"unknown key (known: {', '.join(SCHEDULE_KEYS)})", field=f"schedule.{key}"
            )
    steps = _whole(schedule, "steps", 1, MAX_SCHEDULE_STEPS)
    if steps is None:
        raise ValidationFailed(f"is required: the number of training steps (1 to {MAX_SCHEDULE_STEPS})",
                               field="schedule.steps")  # fmt: skip
    groups_per_step = _whole(schedule, "groups_per_step", 1, MAX_GROUPS_PER_STEP)
    epochs = _whole(schedule, "epochs", 1, MAX_EPOCHS) or 1
    warmup = _whole(schedule, "warmup_steps", 0, steps - 1) or 0  # a step at the peak at least
    seed = _whole(schedule, "seed", 0, SEED_MAX) or 0
    job_config, _ = training_job_config(experimental_config)
    if (
        schedule.get("learning_rate") is not None
        and (experimental_config or {}).get("learning_rate") is not None
    ):
        raise ValidationFailed(
            "give the peak once: here, or as experimental_config.learning_rate",
            field="schedule.learning_rate",
        )
    given = {key: value for key, value in schedule.items() if value is not None}  # null: left out
    try:  # the run config's own checks of these four (types, bounds, choices)
        config = replace(
            job_config,
            learning_rate=given.get("learning_rate", job_config.learning_rate),
            lr_schedule=given.get("lr_schedule", "constant"),
            warmup_steps=warmup,
            min_lr_ratio=given.get("min_lr_ratio", job_config.min_lr_ratio),
        )
    except ConfigError as exc:
        raise ValidationFailed(exc.message, field=f"schedule.{exc.field}") from exc
    rates = [learning_rate_at(config, index, steps) for index in range(1, steps + 1)]
    return TrainingSchedule(
        steps=steps, groups_per_step=groups_per_step, epochs=epochs, seed=seed, rates=rates
    )


def schedule_batches(
    *, groups: int, steps: int, epochs: int, groups_per_step: int | None, seed: int
) -> list[list[int]]:
    """The indices of the groups each step trains on: ``epochs`` passes over ``groups``, each pass
    shuffled (one ``random.Random(seed)`` for all of them, so a seed gives one order), cut into
    ``steps`` consecutive batches: of ``groups_per_step`` each (what the steps do not reach of the
    last pass is not trained), or, without it, as even as can be (sizes differ by at most one,
    every pass's every group trained). A batch may hold a group twice where two passes meet."""
    shuffler = random.Random(seed)
    order: list[int] = []
    for _ in range(epochs):
        one_pass = list(range(groups))
        shuffler.shuffle(one_pass)
        order += one_pass
    if groups_per_step is None:
        base, extra = divmod(len(order), steps)
        sizes = [base + (1 if index < extra else 0) for index in range(steps)]
    else:
        sizes = [groups_per_step] * steps
    if min(sizes) < 1 or sum(sizes) > len(order):
        raise ValueError(f"{steps} steps of {sizes[0]} groups need more than {epochs} × {groups} groups")
    batches, start = [], 0
    for size in sizes:
        batches.append(order[start : start + size])
        start += size
    return batches


def training_schedule_from_completions(
    *,
    model: TrainableModel,
    completions: list[StoredCompletion],
    schedule: Any,
    experimental_config: Any = None,
    created_by: Any = None,
) -> tuple[list[ScheduledStep], dict[str, int]]:
    """Several training steps of ``model`` on its stored completions: the groups built once, as
    for one step (``completion_groups``), cut into the steps' batches (``schedule_batches``), each
    step queued as one training job in step order (see the module's order invariant) with its
    learning rate from the schedule merged into ``experimental_config``. Each step's run event names
    the completions it trains on, its step in the schedule and its rate. All steps or none: one
    refused job refuses the schedule. The jobs name the first one as their schedule; a failed step
    cancels the later ones (they would train on a checkpoint the schedule did not plan)."""
    checked = training_schedule_check(schedule, experimental_config=experimental_config)
    built = completion_groups(model=model, completions=completions)
    available = checked.epochs * len(built.groups)
    if checked.groups_per_step is not None and checked.steps * checked.groups_per_step > available:
        raise ValidationFailed(
            f"{checked.steps} steps of {checked.groups_per_step} groups need {checked.steps * checked.groups_per_step}; "
            f"there are {len(built.groups)} groups × {checked.epochs} epochs",
            field="schedule.groups_per_step",
        )
    if checked.steps > available:
        raise ValidationFailed(
            f"{checked.steps} steps need a group each; there are {len(built.groups)} groups × {checked.epochs} epochs",
            field="schedule.steps",
        )
    batches = schedule_batches(groups=len(built.groups), steps=checked.steps, epochs=checked.epochs,
                               groups_per_step=checked.groups_per_step, seed=checked.seed)  # fmt: skip
    position = {row.pk: index for index, row in enumerate(built.used)}
    scheduled = []
    with transaction.atomic():
        for step, (batch, rate) in enumerate(zip(batches, checked.rates, strict=True), start=1):
            groups = [built.groups[index] for index in batch]
            job = training_job_create(
                model=model, trajectory_groups=[{"trajectories": group.trajectories} for group in groups],
                experimental_config={**(experimental_config or {}), "learning_rate": rate}, created_by=created_by,
            )  # fmt: skip
            used = sorted({row.pk: row for group in groups for row in group.rows}.values(),
                          key=lambda row: position[row.pk])  # fmt: skip
            _lineage(
                job,
                used,
                {"step": step, "steps": checked.steps, "learning_rate": rate, "groups": len(groups)},
            )
            scheduled.append(ScheduledStep(step, job, rate, len(groups), len(used)))
        first = scheduled[0].job
        TrainingJob.objects.filter(pk__in=[each.job.pk for each in scheduled]).update(schedule=first)
        for each in scheduled:
            each.job.schedule_id = first.pk
    counts = {
        **built.counts,
        "epochs": checked.epochs,
        "groups_scheduled": sum(len(batch) for batch in batches),
        "groups_unused": available - sum(len(batch) for batch in batches),
        "steps_without_signal": sum(
            not any(built.groups[index].trainable for index in batch) for batch in batches
        ),
    }
    return scheduled, counts


def training_schedule_status(jobs: list[TrainingJob]) -> str:
    """A schedule's status from its jobs in step order: ``queued`` before its first step starts,
    ``running`` while a step is unfinished, then ``succeeded``, or ``cancelled`` when its first step
    that did not succeed was cancelled (not trained), else ``failed``."""
    if any(job.status in UNFINISHED for job in jobs):
        return (
            TrainingJobStatus.QUEUED
            if jobs[0].status == TrainingJobStatus.QUEUED
            else TrainingJobStatus.RUNNING
        )
    unsuccessful = [job for job in jobs if job.status != TrainingJobStatus.SUCCEEDED]
    if not unsuccessful:
        return TrainingJobStatus.SUCCEEDED
    return "cancelled" if unsuccessful[0].error.startswith(CANCELLED) else TrainingJobStatus.FAILED
