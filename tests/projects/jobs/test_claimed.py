"""The frame a run and an evaluation share (projects.jobs.claimed), driven with plain functions:
a claim that says no is a no-op, a failure of the work is recorded (never raised), the outcome is
recorded after the heartbeat stopped, and a lost claim shows on the heartbeat."""

from __future__ import annotations

import time
from typing import Any

import pytest

from projects.jobs import claimed
from projects.jobs.claimed import Claimed, Job

# The frame closes stale database connections as a worker would: outside a test transaction.
pytestmark = pytest.mark.django_db(transaction=True)


class Recorder:
    """A job's claim, beat, fail and finish as plain methods that note each call."""

    def __init__(self, *, owned: bool = True, beats_ours: bool = True) -> None:
        self.owned, self.beats_ours = owned, beats_ours
        self.calls: list[tuple[Any, ...]] = []

    def claim(self, row_id: int, worker: str) -> str | None:
        self.calls.append(("claim", row_id))
        return f"row-{row_id}" if self.owned else None

    def beat(self, row_id: int, worker: str) -> bool:
        self.calls.append(("beat", row_id))
        return self.beats_ours

    def fail(self, row_id: int, worker: str, exc: BaseException) -> None:
        self.calls.append(("fail", row_id, type(exc).__name__, claimed.readable(exc)))

    def finish(self, row: str, outcome: str) -> None:
        self.calls.append(("finish", row, outcome))

    def job(self, work: Any, *, expected: tuple[type[Exception], ...] = ()) -> Job[str]:
        return Job(
            kind="thing",
            claim=self.claim,
            beat=self.beat,
            work=work,
            fail=self.fail,
            finish=self.finish,
            expected_errors=expected,
        )


@pytest.fixture
def fast_heartbeat(settings):
    settings.RUN_HEARTBEAT_TIMEOUT_S = 0.8  # a beat every 0.2 s
    settings.TORCH_THREADS = 0


def test_a_row_not_claimed_is_skipped_without_working(fast_heartbeat):
    recorder = Recorder(owned=False)
    assert claimed.work_on(recorder.job(lambda c: pytest.fail("worked")), 7) == "skipped"
    assert recorder.calls == [("claim", 7)]


def test_the_work_gets_the_row_and_its_outcome_is_recorded_after_the_heartbeat_stopped(fast_heartbeat):
    recorder = Recorder()
    seen: list[Claimed[str]] = []

    def work(claim: Claimed[str]) -> str:
        seen.append(claim)
        assert claim.heartbeat.is_alive()
        return "succeeded"

    assert claimed.work_on(recorder.job(work), 3) == "succeeded"
    assert seen[0].row == "row-3" and seen[0].worker == claimed.worker_id()
    assert not seen[0].heartbeat.is_alive()
    assert recorder.calls[-1] == ("finish", "row-3", "succeeded")


def test_a_failure_of_the_work_is_recorded_readably_and_not_finished(fast_heartbeat, caplog):
    recorder = Recorder()

    def work(claim: Claimed[str]) -> str:
        raise ValueError("no rows")

    assert claimed.work_on(recorder.job(work), 4) == "failed"
    (fail,) = [call for call in recorder.calls if call[0] == "fail"]
    assert fail[:3] == ("fail", 4, "ValueError") and fail[3].startswith(
        "ValueError: no rows (at test_claimed.py:"
    )
    assert not [call for call in recorder.calls if call[0] == "finish"]
    assert "thing 4 failed" in caplog.text


def test_an_expected_error_is_recorded_without_a_traceback_in_the_log(fast_heartbeat, caplog):
    recorder = Recorder()

    def work(claim: Claimed[str]) -> str:
        raise KeyError("grader")

    assert claimed.work_on(recorder.job(work, expected=(KeyError,)), 5) == "failed"
    assert [call[:3] for call in recorder.calls if call[0] == "fail"] == [("fail", 5, "KeyError")]
    assert "thing 5 failed" not in caplog.text


def test_a_heartbeat_that_is_no_longer_ours_marks_the_work_lost(fast_heartbeat):
    recorder = Recorder(beats_ours=False)

    def work(claim: Claimed[str]) -> str:
        deadline = time.monotonic() + 5
        while not claim.heartbeat.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        return "lost" if claim.heartbeat.lost else "timed out"

    assert claimed.work_on(recorder.job(work), 6) == "lost"
    assert ("beat", 6) in recorder.calls
