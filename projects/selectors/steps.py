"""Reads of a run's steps: metrics, checkpoints and trajectories (the trajectory viewer's pages)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db.models import BigIntegerField, Func, Q, QuerySet

from projects.models import (
    Checkpoint,
    Run,
    RunEvent,
    StepMetrics,
    TaskRow,
    Team,
    TrainableModel,
    Trajectory,
)
from projects.selectors._scoping import scoped
from training.recipes.signal import is_zero_variance
from training.rollouts.trajectory import overlong_penalty


def run_step_metrics(*, run: Run) -> QuerySet[StepMetrics]:
    return StepMetrics.objects.filter(run=run).order_by("step")


def run_heldout_before(*, run: Run) -> dict[str, Any] | None:
    """An SFT or DPO run's held-out figures before its first step (``{"step", "heldout_loss", …}``):
    the event ``training.recipes.supervised.run_supervised`` sends then, not a step's metrics."""
    event = (
        RunEvent.objects.filter(run=run, data__has_key="heldout_loss", data__step=run.start_step)
        .order_by("id")
        .first()
    )
    return event.data if event is not None else None


def run_checkpoints(*, run: Run) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run=run).order_by("step")


def run_trajectories(*, run: Run, step: int | None = None) -> QuerySet[Trajectory]:
    trajectories = Trajectory.objects.filter(run=run)
    if step is not None:
        trajectories = trajectories.filter(step=step)
    return trajectories.order_by("step", "group_index", "sample_index")


def trajectory_steps(*, run: Run) -> list[int]:
    return list(Trajectory.objects.filter(run=run).values_list("step", flat=True).distinct().order_by("step"))


def trajectory_group_indexes(*, run: Run, step: int) -> list[int]:
    return list(
        Trajectory.objects.filter(run=run, step=step)
        .values_list("group_index", flat=True)
        .distinct()
        .order_by("group_index")
    )


def trajectory_group_indexes_with_variance(*, run: Run, step: int) -> list[int]:
    """The step's groups whose training rewards (the grader's plus any length penalty) differ:
    the groups GRPO learns from."""
    rows = Trajectory.objects.filter(run=run, step=step).only(*_SIGNAL_FIELDS)
    signals = trajectory_update_signals(run=run, trajectories=rows)
    groups: dict[int, list[float]] = {}
    for row in rows:
        groups.setdefault(row.group_index, []).append(signals[row.pk].training_reward)
    return sorted(index for index, rewards in groups.items() if not is_zero_variance(rewards))


# What trajectory_update_signals reads of a row.
_SIGNAL_FIELDS = ("id", "step", "group_index", "reward", "metrics", "completion_tokens", "finish_reason")


@dataclass(frozen=True)
class UpdateSignal:
    """What a step's update made of one trajectory."""

    length_penalty: float  # added to the grader's reward (DAPO's soft overlong penalty; 0 when off)
    training_reward: float  # reward + length_penalty: what the group's advantages compare
    advantage: float  # the advantage the update trained it with; 0.0 where it was left out
    trained: bool  # False: left out (a zero-variance group, a group dynamic sampling replaced, ...)
    stored: bool  # True: recorded by the trainer with the step; False: recomputed (older rows)


def trajectory_update_signals(*, run: Run, trajectories: Iterable[Trajectory]) -> dict[int, UpdateSignal]:
    """By trajectory id, what the update made of each of ``trajectories`` (whole groups): the
    values the trainer stored with the step (training.runs.steps.record_update_signal; a client
    job's ``advantage``, training.runs.art_step), or for rows recorded before it stored them the
    same computation again (training.recipes.grpo.update_advantages over the run's config; the longest
    turn read as the completion's length, exact for single-turn runs)."""
    config = run.config or {}
    max_new_tokens = int(config.get("max_new_tokens") or 0)
    buffer = int(config.get("length_penalty_buffer") or 0)
    overlong_filter = bool(config.get("overlong_filter"))
    scale = bool(config.get("scale_rewards", True))
    groups: dict[tuple[int, int], list[Trajectory]] = {}
    for row in trajectories:
        groups.setdefault((row.step, row.group_index), []).append(row)
    signals: dict[int, UpdateSignal] = {}
    for group in groups.values():
        if all("advantage" in (row.metrics or {}) for row in group):
            for row in group:
                penalty = float(row.metrics.get("length_penalty", 0.0))
                stored = float(row.metrics["advantage"])
                # A client job stores no "trained": ART leaves out trajectories of advantage 0.
                trained = bool(row.metrics.get("trained", stored != 0.0))
                signals[row.pk] = UpdateSignal(penalty, row.reward + penalty, stored, trained, stored=True)
            continue
        penalties = [overlong_penalty(row.completion_tokens, max_new_tokens, buffer) for row in group]
        rewards = [row.reward + penalty for row, penalty in zip(group, penalties, strict=True)]
        trainable = [
            not (overlong_filter and (row.finish_reason == "length" or row.completion_tokens == 0))
            for row in group
        ]
        # torch loads here, for rows recorded before the trainer stored its values, not at the
        # start of every Django process
        from training.recipes.grpo import update_advantages

        used = update_advantages(rewards, trainable, scale=scale)
        for row, penalty, reward, advantage in zip(group, penalties, rewards, used, strict=True):
            signals[row.pk] = UpdateSignal(
                penalty, reward, 0.0 if advantage is None else advantage, advantage is not None, stored=False
            )
    return signals


def trajectory_page_update_signals(*, run: Run, page: list[Trajectory]) -> dict[int, UpdateSignal]:
    """trajectory_update_signals for a page of rows, which may cut a group: a group recorded
    without its signal is read whole (one query for all of them) to recompute it."""
    missing = {(row.step, row.group_index) for row in page if "advantage" not in (row.metrics or {})}
    rows: list[Trajectory] = [row for row in page if (row.step, row.group_index) not in missing]
    if missing:
        where = Q()
        for step, group_index in missing:
            where |= Q(step=step, group_index=group_index)
        rows += list(Trajectory.objects.filter(where, run=run).only(*_SIGNAL_FIELDS))
    return trajectory_update_signals(run=run, trajectories=rows)


def run_step_sample_means(*, run: Run) -> dict[int, dict[str, Any]]:
    """Per step, the mean completion length of its trajectories and the mean of each sub-reward:
    ``{step: {"completion_tokens": float, "sub_rewards": {name: float}}}``."""
    sums: dict[int, dict[str, Any]] = {}
    rows = Trajectory.objects.filter(run=run).values_list("step", "completion_tokens", "sub_rewards")
    for step, tokens, sub_rewards in rows.iterator():
        entry = sums.setdefault(step, {"n": 0, "tokens": 0, "sub_rewards": {}})
        entry["n"] += 1
        entry["tokens"] += tokens
        for name, value in (sub_rewards or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total, count = entry["sub_rewards"].get(name, (0.0, 0))
                entry["sub_rewards"][name] = (total + value, count + 1)
    return {
        step: {
            "completion_tokens": entry["tokens"] / entry["n"],
            "sub_rewards": {name: total / count for name, (total, count) in entry["sub_rewards"].items()},
        }
        for step, entry in sums.items()
    }


def run_task_row_items(*, run: Run, indexes: list[int]) -> dict[int, Any]:
    """The ``item`` (the reference a grader reads) of the run's task rows at ``indexes``."""
    rows = TaskRow.objects.filter(task_set_id=run.task_set_id, index__in=indexes)
    return {index: (data or {}).get("item") for index, data in rows.values_list("index", "data")}


def trajectory_group(*, run: Run, step: int, group_index: int) -> list[Trajectory]:
    """One group's trajectories, best reward first (the trajectory viewer's columns)."""
    return list(
        Trajectory.objects.filter(run=run, step=step, group_index=group_index).order_by(
            "-reward", "sample_index"
        )
    )


class UnixSeconds(Func):
    """Whole seconds since 1970 (UTC) of a datetime column, computed by the database.

    Django's ``Extract("epoch")`` is PostgreSQL's alone: on SQLite, the embedded default, its date
    function raises and ``/v1/models`` answered 500. SQLite keeps a datetime as UTC text
    (``YYYY-MM-DD HH:MM:SS.ffffff``); its ``strftime('%s', ...)`` reads the first 19 characters, the
    whole seconds (given the fraction it rounds to milliseconds, so 12:00:00.999999 became 12:00:01)."""

    arity = 1
    output_field = BigIntegerField()
    template = "CAST(FLOOR(EXTRACT(EPOCH FROM %(expressions)s)) AS bigint)"  # PostgreSQL

    def as_sqlite(self, compiler: Any, connection: Any, **extra_context: Any) -> tuple[str, tuple]:
        # '%s' goes in as a parameter: in the SQL text Django would read it as a placeholder.
        sql, params = self.as_sql(
            compiler,
            connection,
            template="CAST(strftime(%%s, substr(%(expressions)s, 1, 19)) AS INTEGER)",
            **extra_context,
        )
        return sql, ("%s", *params)


def team_checkpoint_names(*, team: Team) -> list[tuple[int, str, str, int, int]]:
    """``(model id, project name, model name, step, created)`` of every checkpoint of the team, by
    model then step, ``created`` in Unix seconds (OpenAI's ``created``): the gateway's model list.
    Plain tuples, not instances, and the seconds from the database rather than a parsed timestamp:
    the list holds every checkpoint, and building model objects, then parsing a timestamp per row,
    was most of its time (benchmarks/api_pg.py)."""
    return list(
        scoped(Checkpoint, team)
        .order_by("model_id", "step")
        .values_list("model_id", "model__project__name", "model__name", "step", UnixSeconds("created_at"))
    )


def checkpoint_latest(*, model: TrainableModel) -> Checkpoint | None:
    return Checkpoint.objects.filter(model=model).order_by("-step").first()


def checkpoint_at(*, model: TrainableModel, step: int) -> Checkpoint | None:
    return Checkpoint.objects.filter(model=model, step=step).first()


def checkpoint_exists(*, model: TrainableModel, step: int) -> bool:
    """Whether checkpoint ``step`` has files to resume from (a client model's step 0 has none:
    it is the untrained adapter, see Checkpoint)."""
    return Checkpoint.objects.filter(model=model, step=step).exclude(path="").exists()
