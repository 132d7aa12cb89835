"""`tool_call` (ours): did the trajectory call a tool, with the right arguments?

    {"type": "tool_call", "tool": "get_weather",
     "arguments": {"city": "{{item.city}}", "units": "metric"},
     "argument_patterns": {"date": "\\\\d{4}-\\\\d{2}-\\\\d{2}"}, "scoring": "all"}

The calls are `sample.output_tools` (filled from the assistant messages' `tool_calls` when not given
directly), each `{"name", "arguments"}` with arguments an object or a JSON string. `arguments` maps
argument paths (dots for nested objects) to expected values: compared as JSON values, a string
being a template (a single-variable template yields the item's value as is). `argument_patterns`
maps paths to regular expressions that must match the whole argument (a non-string argument is
matched as its JSON text). With `scoring` "all" the reward is 1 when some call to `tool` meets every
condition, else 0; with "fraction" it is the best call's fraction of conditions met (a call with no
conditions counts as 1). Not calling the tool at all is 0, not an error: it is the policy's doing.
A match running past the operator's regex timeout is a `regex_timeout` error (training/rewards/patterns.py).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GraderRuntime, Sample, Score
from training.rewards.patterns import PatternError, compile_pattern, matches
from training.rewards.templates import Template, TemplateSyntaxError

SCORING = ("all", "fraction")


class ToolCallGrader(Grader):
    type: ClassVar[str] = "tool_call"
    fields: ClassVar[dict[str, Field]] = {
        "tool": Field("string", required=True, template=True),
        "arguments": Field("object", default={}),
        "argument_patterns": Field("object", default={}),
        "scoring": Field("string", default="all", choices=SCORING),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = []
        for key, expected in spec.get("arguments", {}).items():
            if not key or "" in key.split("."):
                problems.append({"path": f"{path}.arguments.{key}", "message": "must be a dot path like a.b"})
            if isinstance(expected, str):
                try:
                    Template.parse(expected)
                except TemplateSyntaxError as error:
                    problems.append({"path": f"{path}.arguments.{key}", "message": str(error)})
        for key, pattern in spec.get("argument_patterns", {}).items():
            where = f"{path}.argument_patterns.{key}"
            if not key or "" in key.split("."):
                problems.append({"path": where, "message": "must be a dot path like a.b"})
            if not isinstance(pattern, str):
                problems.append({"path": where, "message": "must be a string (a regular expression)"})
                continue
            try:
                compile_pattern(pattern)
            except PatternError as error:
                problems.append({"path": where, "message": f"invalid regular expression: {error}"})
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.tool = Template.parse(spec["tool"])
        self.arguments = {
            tuple(key.split(".")): (Template.parse(value) if isinstance(value, str) else value)
            for key, value in spec["arguments"].items()
        }
        self.patterns = {
            tuple(key.split(".")): compile_pattern(value) for key, value in spec["argument_patterns"].items()
        }
        self.timeout_seconds = self.runtime.sandbox.regex_timeout_seconds
        self.scoring: str = spec["scoring"]

    def score(self, sample: Sample, item: dict[str, Any]) -> Score:
        tool = self.tool.render(sample, item)
        expected = {
            path: (value.value(sample, item) if isinstance(value, Template) else value)
            for path, value in self.arguments.items()
        }
        calls = [call for call in sample.output_tools if isinstance(call, dict) and call.get("name") == tool]
        conditions = len(expected) + len(self.patterns)
        best = 0.0
        for call in calls:
            arguments = _arguments(call.get("arguments"))
            met = sum(1 for path, value in expected.items() if _equal(_lookup(arguments, path), value))
            met += sum(
                1
                for path, pattern in self.patterns.items()
                if _pattern_matches(pattern, _lookup(arguments, path), self.timeout_seconds)
            )
            best = max(best, met / conditions if conditions else 1.0)
        reward = best if self.scoring == "fraction" else float(best == 1.0)
        return Score(reward, {"calls": len(calls), "best_fraction": best})


_MISSING = object()


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return {}  # unreadable arguments meet no condition
    return raw if raw is not None else {}


def _lookup(value: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _equal(actual: Any, expected: Any) -> bool:
    if actual is _MISSING:
        return False
    if isinstance(actual, bool) != isinstance(expected, bool):
        return False
    return bool(actual == expected)


def _pattern_matches(pattern: Any, actual: Any, timeout_seconds: float) -> bool:
    if actual is _MISSING:
        return False
    text = actual if isinstance(actual, str) else json.dumps(actual)
    return matches(pattern, text, mode="fullmatch", timeout_seconds=timeout_seconds)
