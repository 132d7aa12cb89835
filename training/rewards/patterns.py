"""Regular expressions written by spec authors (or rendered from task items), matched against
policy output: the regex grader's `pattern` and the tool_call grader's `argument_patterns`.

Invariant: no author's pattern can stall the process that grades it. Python's `re` has no timeout
and holds the GIL while matching (`^(a+)+$` on 26 characters took 3.4-5 s, x2.2 a character, and
the web process's `/healthz` waited too), so matching uses the `regex` package (mrab-regex) with
`timeout=` (a match that runs longer is a `regex_timeout` grading error: error data, never a
crash; the package counts the process's CPU seconds, so on a crowded machine the wall time is
longer) and `concurrent=True` (the GIL is released while it matches). Its compiler expands fixed
repeat counts (`a{10000000}` takes 6 s to compile, `x{4294967294}` does not finish), so a pattern
whose expansion exceeds MAX_EXPANDED_SIZE is refused before it reaches that compiler.

The language is Python's `re` (what the validator has always accepted):
a pattern must parse with `re` and compile under `regex.VERSION0`, the `re`-compatible mode.
"""

from __future__ import annotations

import re
import re._parser as re_parser  # type: ignore[import-not-found]  # the tree `re` itself compiles
from typing import Any

import regex

from training.rewards.errors import GradingError

FLAGS = {"IGNORECASE": regex.IGNORECASE, "MULTILINE": regex.MULTILINE, "DOTALL": regex.DOTALL}
MODES = ("search", "fullmatch")
# Pattern nodes after expanding every repeat's minimum count (`(ab){3}` is 6). The worst measured
# was about 3 us a node (nested exact repeats), so 10k compile within about 30 ms; an author who
# needs more wants a range (`a{1,100000}` costs nothing).
MAX_EXPANDED_SIZE = 10_000
_REPEATS = {re_parser.MAX_REPEAT, re_parser.MIN_REPEAT, getattr(re_parser, "POSSESSIVE_REPEAT", None)}


class PatternError(ValueError):
    """A pattern that is not valid Python `re` syntax, or too large to compile."""


def flag_bits(names: list[str]) -> int:
    bits = 0
    for name in names:
        bits |= FLAGS[name]
    return bits


def compile_pattern(pattern: str, flags: int = 0) -> Any:
    """The compiled `regex.Pattern` (VERSION0), or PatternError saying why not."""
    try:
        re.compile(pattern, flags)  # `re`'s syntax and messages; it does not expand repeats
        size = _expanded_size(re_parser.parse(pattern, flags))
    except re.error as error:
        raise PatternError(str(error)) from None
    except RecursionError:
        raise PatternError("too deeply nested") from None
    if size > MAX_EXPANDED_SIZE:
        raise PatternError(
            f"repeats too large: more than {MAX_EXPANDED_SIZE:,} elements once each repeat's minimum "
            "count is expanded (use a range such as {1,n} instead of an exact count)"
        )
    try:
        return regex.compile(pattern, flags | regex.VERSION0)
    except regex.error as error:
        raise PatternError(str(error)) from None


def matches(compiled: Any, text: str, *, mode: str, timeout_seconds: float) -> bool:
    """Whether `compiled` matches `text` (`mode` is "search" or "fullmatch"); a `regex_timeout`
    GradingError after `timeout_seconds`, with the GIL released meanwhile."""
    method = compiled.search if mode == "search" else compiled.fullmatch
    try:
        return method(text, timeout=timeout_seconds, concurrent=True) is not None
    except TimeoutError:
        raise GradingError(
            "regex_timeout",
            f"pattern {compiled.pattern!r} ran over {timeout_seconds:g} s on {len(text):,} characters "
            "(catastrophic backtracking: avoid nested quantifiers such as (a+)+)",
        ) from None


def _expanded_size(tree: Any) -> int:
    total = 0
    for op, argument in tree:
        if op in _REPEATS:
            minimum, _maximum, body = argument
            total += max(minimum, 1) * _expanded_size(body)
        else:
            total += 1 + sum(_expanded_size(inner) for inner in _subpatterns(argument))
        if total > MAX_EXPANDED_SIZE:
            return total  # large enough to refuse; stop before the product grows any further
    return total


def _subpatterns(argument: Any) -> list[Any]:
    """The nested pattern trees in a node's argument (groups, branches, look-arounds, conditionals)."""
    if isinstance(argument, re_parser.SubPattern):
        return [argument]
    if isinstance(argument, tuple | list):
        return [tree for element in argument for tree in _subpatterns(element)]
    return []
