"""The two kinds of failure, kept apart on purpose. A bad spec is the author's mistake and is refused
when the reward definition is saved (`GraderSpecError`, every problem at once). A sample that cannot
be graded (unparseable JSON, a missing item key) is the policy's or the data's doing: `GradingError`
becomes an error entry and `error_reward`, so one odd trajectory never stops a training step."""


class GradingError(Exception):
    """A sample-dependent failure; `Grader.grade` turns it into an error entry, never a crash."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class GraderSpecError(ValueError):
    """An invalid grader spec. `problems` lists all of them, each `{"path", "message"}`."""

    def __init__(self, problems: list[dict[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p['path']}: {p['message']}" for p in problems))
