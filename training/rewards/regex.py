"""`regex`: reward whether a rendered input matches a regular expression (our own grader type).

    {"type": "regex", "input": "{{sample.output_text}}", "pattern": "^{{item.answer}}$",
     "flags": ["IGNORECASE"], "mode": "fullmatch", "score_on_match": 1.0, "score_on_miss": 0.0}

`pattern` may be a template. Variables are inserted raw, not escaped, so an item can carry its own
regex; to match an item's value literally, store it escaped. The literal parts of a templated
pattern are checked at validation; a pattern that only breaks after rendering is a `regex_error`.
A match that runs past the operator's `regex_timeout_seconds` (1 s by default) is a `regex_timeout`
error (the `error_reward`, never a stalled worker or web process): see `training/rewards/patterns.py`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GraderRuntime, Sample
from training.rewards.errors import GradingError
from training.rewards.patterns import FLAGS, MODES, PatternError, compile_pattern, flag_bits, matches
from training.rewards.templates import Template, TemplateSyntaxError

# Backtracking cost grows with input length (polynomially for the usual culprits like `.*a.*b.*c`,
# exponentially for nested quantifiers like `(a|a)+$`) and policy outputs can be arbitrarily long:
# 20k characters is far beyond a typical answer. The match timeout bounds what is left.
MAX_INPUT_CHARS = 20_000
# Stands in for each variable when checking a templated pattern's literal parts: a plain letter is
# valid in every position a value plausibly goes (a group, a character class, a group name).
STAND_IN = "x"


class RegexGrader(Grader):
    type: ClassVar[str] = "regex"
    fields: ClassVar[dict[str, Field]] = {
        "input": Field("string", default="{{sample.output_text}}", template=True),
        "pattern": Field("string", required=True, template=True),
        "flags": Field("string_list", default=[], choices=tuple(FLAGS)),
        "mode": Field("string", default="search", choices=MODES),
        "score_on_match": Field("number", default=1.0),
        "score_on_miss": Field("number", default=0.0),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        if "pattern" not in spec:
            return []  # missing or already reported as the wrong type or a bad template
        try:
            template = Template.parse(spec["pattern"])
        except TemplateSyntaxError:
            return []  # already reported by the field check
        # Without valid flags, check the pattern without them rather than skip it.
        flags = flag_bits(spec["flags"]) if "flags" in spec else 0
        try:
            compile_pattern(template.with_stand_in(STAND_IN), flags)
        except PatternError as error:
            note = "" if template.is_literal else f" (with each variable replaced by {STAND_IN!r})"
            return [{"path": f"{path}.pattern", "message": f"invalid regular expression{note}: {error}"}]
        return []

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.input = Template.parse(spec["input"])
        self.pattern = Template.parse(spec["pattern"])
        self.flags = flag_bits(spec["flags"])
        self.mode: str = spec["mode"]
        self.score_on_match: float = spec["score_on_match"]
        self.score_on_miss: float = spec["score_on_miss"]
        self.timeout_seconds = self.runtime.sandbox.regex_timeout_seconds
        # A literal pattern is compiled once; a templated one per sample (regex caches recent ones).
        self.compiled = compile_pattern(spec["pattern"], self.flags) if self.pattern.is_literal else None

    def score(self, sample: Sample, item: dict[str, Any]) -> float:
        text = self.input.render(sample, item)[:MAX_INPUT_CHARS]
        compiled = self.compiled
        if compiled is None:
            pattern = self.pattern.render(sample, item)
            try:
                compiled = compile_pattern(pattern, self.flags)
            except PatternError as error:
                raise GradingError(
                    "regex_error", f"rendered pattern {pattern!r} is invalid: {error}"
                ) from None
        matched = matches(compiled, text, mode=self.mode, timeout_seconds=self.timeout_seconds)
        return self.score_on_match if matched else self.score_on_miss
