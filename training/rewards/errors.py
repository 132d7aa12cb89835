"""The kinds of failure, kept apart on purpose. A bad spec is the author's mistake and is refused
when the reward definition is saved (`GraderSpecError`, every problem at once). A sample that cannot
be graded (unparseable JSON, a missing item key, a judge that answers nonsense) is the policy's, the
data's or the judge's doing: `GradingError` becomes an error entry and `error_reward`, so one odd
trajectory never stops a training step. A grader that cannot work at all in this process (a judge
grader without a configured judge endpoint) is the caller's mistake: `GraderSetupError`."""

from __future__ import annotations

from typing import Any


class GradingError(Exception):
    """A sample-dependent failure; `Grader.grade` turns it into an error entry, never a crash.

    A judge call that failed after the judge answered still cost tokens: `token_usage` and
    `sampled_model_name` carry them so the result can record what was spent."""

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        token_usage: dict[str, dict[str, int]] | None = None,
        sampled_model_name: str | None = None,
        scores: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.token_usage = token_usage or {}
        self.sampled_model_name = sampled_model_name
        self.scores = scores or {}


class GraderSpecError(ValueError):
    """An invalid grader spec. `problems` lists all of them, each `{"path", "message"}`."""

    def __init__(self, problems: list[dict[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p['path']}: {p['message']}" for p in problems))


class GraderSetupError(ValueError):
    """A valid spec that cannot be built here, e.g. a judge grader with no judge endpoint given."""


class RewardFailure(RuntimeError):
    """Too many samples of a step could not be graded: the run fails with this message."""
