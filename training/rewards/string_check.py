"""`string_check`: compare two rendered templates, compatible with OpenAI's grader of that name.

    {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
     "reference": "{{item.answer}}", "operation": "eq"}

Reward 1.0 when the comparison holds, else 0.0. `like` and `ilike` mean "input contains reference"
(case-sensitive, case-insensitive), as in OpenAI's grader, not SQL's LIKE with wildcards.
"""

from __future__ import annotations

from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GraderRuntime, Sample
from training.rewards.templates import Template

OPERATIONS = ("eq", "ne", "like", "ilike")


class StringCheckGrader(Grader):
    type: ClassVar[str] = "string_check"
    fields: ClassVar[dict[str, Field]] = {
        "input": Field("string", required=True, template=True),
        "reference": Field("string", required=True, template=True),
        "operation": Field("string", required=True, choices=OPERATIONS),
    }

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.input = Template.parse(spec["input"])
        self.reference = Template.parse(spec["reference"])
        self.operation: str = spec["operation"]

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        text = self.input.render(sample, item)
        reference = self.reference.render(sample, item)
        if self.operation == "eq":
            holds = text == reference
        elif self.operation == "ne":
            holds = text != reference
        elif self.operation == "like":
            holds = reference in text
        else:  # ilike; casefold rather than lower so that e.g. "Straße" contains "STRASSE".
            holds = reference.casefold() in text.casefold()
        return 1.0 if holds else 0.0
