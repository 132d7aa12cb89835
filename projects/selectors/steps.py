"""Reads of a run's steps: metrics, checkpoints and trajectories (the trajectory viewer's pages)."""

from __future__ import annotations

from django.db.models import QuerySet

from projects.models import Checkpoint, Run, StepMetrics, TrainableModel, Trajectory


def run_step_metrics(*, run: Run) -> QuerySet[StepMetrics]:
    return StepMetrics.objects.filter(run=run).order_by("step")


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


def trajectory_group(*, run: Run, step: int, group_index: int) -> list[Trajectory]:
    """One group's trajectories, best reward first (the trajectory viewer's columns)."""
    return list(
        Trajectory.objects.filter(run=run, step=step, group_index=group_index).order_by(
            "-reward", "sample_index"
        )
    )


def checkpoint_latest(*, model: TrainableModel) -> Checkpoint | None:
    return Checkpoint.objects.filter(model=model).order_by("-step").first()


def checkpoint_exists(*, model: TrainableModel, step: int) -> bool:
    """Whether checkpoint ``step`` has files to resume from (a client model's step 0 has none:
    it is the untrained adapter, see Checkpoint)."""
    return Checkpoint.objects.filter(model=model, step=step).exclude(path="").exists()
