"""Caps on the sandboxes a host runs at once (python graders, MCP stdio servers): per team and in total.

Invariant: a slot is an exclusive `flock` on one file in the operator's slot directory, held for a
sandbox's whole life and shared by every process of the host (web, workers, inference). The kernel
drops a lock when its holder's descriptor closes, so a process that dies never leaks a slot. A
caller that finds every slot taken waits up to `wait_seconds` (workers queue; the web waits
briefly) and then gets `SlotsBusy`, which the API answers with a 429.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

POLL_SECONDS = 0.05


@dataclass(frozen=True)
class SlotPolicy:
    """The operator's caps (settings); `directory` empty means no cap (a library default, not the
    platform's: artweb's settings always set one)."""

    directory: str = ""  # where the slot files live; one directory for the whole host
    total: int = 16  # sandboxes at once on this host, all teams together
    per_team: int = 4  # sandboxes at once for one team
    wait_seconds: float = 0.0  # how long to wait for a free slot before SlotsBusy


class SlotsBusy(RuntimeError):
    """Every slot is taken (for this team, or in total) and none freed within the wait."""

    def __init__(self, scope: str, limit: int, waited: float) -> None:
        self.scope = scope
        self.limit = limit
        self.retry_after = 1
        where = "for this team" if scope == "team" else "on this host"
        super().__init__(
            f"too many sandboxes running {where} (the limit is {limit}); waited {waited:g} s, try again shortly"
        )


def _try_lock(path: Path) -> int | None:
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        return None
    return descriptor


def _first_free(paths: list[Path]) -> int | None:
    for path in paths:
        descriptor = _try_lock(path)
        if descriptor is not None:
            return descriptor
    return None


@contextlib.contextmanager
def sandbox_slot(policy: SlotPolicy, team: str) -> Iterator[None]:
    """Hold one of `team`'s slots and one of the host's for the block; raises SlotsBusy."""
    if not policy.directory:
        yield
        return
    directory = Path(policy.directory)
    directory.mkdir(parents=True, exist_ok=True)
    team_tag = hashlib.sha256(team.encode()).hexdigest()[:16]
    team_paths = [directory / f"team-{team_tag}-{i}.lock" for i in range(policy.per_team)]
    total_paths = [directory / f"total-{i}.lock" for i in range(policy.total)]
    started = time.monotonic()
    while True:
        held: list[int] = []
        scope = "team"
        team_lock = _first_free(team_paths)
        if team_lock is not None:
            held.append(team_lock)
            scope = "total"
            total_lock = _first_free(total_paths)
            if total_lock is not None:
                held.append(total_lock)
                break
        for descriptor in held:
            os.close(descriptor)
        waited = time.monotonic() - started
        if waited >= policy.wait_seconds:
            limit = policy.per_team if scope == "team" else policy.total
            raise SlotsBusy(scope, limit, round(waited, 2))
        time.sleep(POLL_SECONDS)
    try:
        yield
    finally:
        for descriptor in held:
            os.close(descriptor)


class SlotHolder:
    """A slot held across calls (a sandbox's start to its stop), for classes that cannot use `with`."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    def acquire(self, policy: SlotPolicy, team: str) -> None:
        if self._stack is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(sandbox_slot(policy, team))
        self._stack = stack

    def release(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
