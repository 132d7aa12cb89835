"""`environment` (ours): the reward the environment itself gave the episode (a game's outcome).

    {"type": "environment", "field": "reward"}
    {"type": "environment", "field": "result", "values": {"win": 1, "draw": 0.5, "loss": 0}}

Reads `sample.outcome[field]` (see `training/environments`: tic_tac_toe and 2048 report `reward`,
`result`, ...). A number is the reward as it is; with `values`, the field's value (a string such
as "win") is mapped to a reward, and a value missing from the map scores `default`. An outcome
without the field is a `sample_parse_error`: the environment did not report what the spec expects.
"""

from __future__ import annotations

from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GraderRuntime, Sample, Score, is_number
from training.rewards.errors import GradingError


class EnvironmentGrader(Grader):
    type: ClassVar[str] = "environment"
    fields: ClassVar[dict[str, Field]] = {
        "field": Field("string", default="reward"),
        "values": Field("object"),
        "default": Field("number", default=0.0),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = []
        if "field" in spec and not spec["field"]:
            problems.append({"path": f"{path}.field", "message": "must not be empty"})
        for key, value in spec.get("values", {}).items():
            if not is_number(value):
                problems.append({"path": f"{path}.values.{key}", "message": "must be a finite number"})
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.field: str = spec["field"]
        self.values: dict[str, float] | None = spec.get("values")
        self.default: float = spec["default"]

    def score(self, sample: Sample, item: dict[str, Any]) -> Score:
        if self.field not in sample.outcome:
            known = ", ".join(sorted(sample.outcome)) or "none"
            raise GradingError(
                "sample_parse_error", f"the environment's outcome has no {self.field!r} (it has: {known})"
            )
        value = sample.outcome[self.field]
        if self.values is not None:
            reward = float(self.values.get(str(value), self.default))
        elif is_number(value):
            reward = float(value)
        else:
            raise GradingError(
                "sample_parse_error",
                f"outcome {self.field!r} is {value!r}, not a number (map it with 'values')",
            )
        return Score(reward, {"outcome": {self.field: value}})
