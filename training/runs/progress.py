"""What a run is doing now, said as events: one ``phase`` event when a phase begins, and while the
rollouts of a step (or an evaluation) go on, a progress event at most every ``interval_s`` seconds
saying how many groups are done ("rollouts 3/8 groups"). A few per step, never one per sample or
token: the run page shows the latest, the terminal prints each (artweb/management/commands/up.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from training.rollouts.agent import RolloutProgress

PROGRESS_INTERVAL_S = 5.0


def step_label(step: int, *, start_step: int, final_step: int) -> str:
    """A step as every run line names it: the model's step, the number its checkpoint has.
    "Step 3/20" for a run from the base model; a run that continues a model from step 20 for 3
    steps says "Step 23 (3 of 3 in this run)", not "Step 23/23" in one line and "Step 3/3" in the
    next (the run page once showed both)."""
    if not start_step:
        return f"Step {step}/{final_step}"
    return f"Step {step} ({step - start_step} of {final_step - start_step} in this run)"


def phase(hooks: Any, name: str, message: str, **data: Any) -> None:
    """Say what the run is doing now: a message event with ``data.phase``."""
    hooks.event(message, data={"phase": name, **data})


def progress_events(
    hooks: Any,
    name: str,
    label: str,
    *,
    interval_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    **data: Any,
) -> Callable[[RolloutProgress], None]:
    """An ``on_progress`` for ``rollout_groups`` that reports ``label`` (e.g. "Step 3/20: rollouts",
    ``step_label``'s words)
    with k/N groups done as a ``name`` phase event, at most once per ``interval_s``. The moment every
    group is done is not reported: the next phase's event says it."""
    interval = PROGRESS_INTERVAL_S if interval_s is None else interval_s
    last = clock()

    def report(progress: RolloutProgress) -> None:
        nonlocal last
        now = clock()
        if now - last < interval or progress.groups_done == progress.groups:
            return
        last = now
        turn = f", turn {progress.turn}/{progress.max_turns}" if progress.max_turns > 1 else ""
        phase(
            hooks,
            name,
            f"{label}: {progress.groups_done}/{progress.groups} groups done{turn}"
            f" ({progress.finished_in_turn}/{progress.running_in_turn} samples finished this turn)",
            groups=progress.groups,
            groups_done=progress.groups_done,
            turn=progress.turn,
            samples_finished=progress.finished_in_turn,
            samples_running=progress.running_in_turn,
            **data,
        )

    return report
