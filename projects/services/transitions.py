"""The one state-machine transition over claimed work (runs, evaluations, client training jobs).

Each kind of work declares a ``Machine``: its model, the allowed transitions, its terminal states
and how a refusal reads. ``work_transition`` moves one row under ``select_for_update``: refused
(InvalidTransition, field ``status``) unless the table allows it; a terminal state sets
``finished_at``; ``updates`` are written with it; ``announce`` (the caller's event and webhook)
runs in the same transaction, so the history and the state never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.db import transaction
from django.utils import timezone

from projects.errors import InvalidTransition
from projects.models.base import ClaimedWork

Work = TypeVar("Work", bound=ClaimedWork)


@dataclass(frozen=True)
class Machine(Generic[Work]):
    model: type[Work]
    transitions: dict[str, set[str]]
    terminal: frozenset[str]
    noun: str  # "run", "evaluation", "training job": what a refusal calls it
    ended_reads_already: bool = False  # refusing a finished row: "the evaluation already failed"

    def refusal(self, status: str, to: str) -> str:
        if self.ended_reads_already and status in self.terminal:
            return f"the {self.noun} already {status}"
        return f"a {status} {self.noun} cannot become {to}"


def work_transition(
    machine: Machine[Work],
    *,
    pk: int,
    to: str,
    updates: dict[str, Any] | None = None,
    announce: Callable[[Work, str], None] | None = None,
) -> Work:
    """Move row ``pk`` to ``to`` (see the module doc); ``announce(row, previous_status)``."""
    with transaction.atomic():
        row = machine.model.objects.select_for_update().get(pk=pk)  # type: ignore[attr-defined]
        status = row.status
        if to not in machine.transitions[status]:
            raise InvalidTransition(machine.refusal(status, to), field="status")
        row.status = to
        if to in machine.terminal:
            row.finished_at = timezone.now()
        for key, value in (updates or {}).items():
            setattr(row, key, value)
        row.save()
        if announce is not None:
            announce(row, status)
    return row
