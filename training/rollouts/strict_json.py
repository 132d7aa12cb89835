"""The one JSON reader for everything artweb accepts from outside: REST API bodies, JSONL task-set
uploads, the gateway's and the inference server's chat completion bodies, the dashboard's JSON
text areas. Standard library only (the inference server must not import Django).

It refuses, with the position, what would otherwise crash a later step or could not be stored:
- nesting deeper than ``max_depth`` (checked by a flat scan before parsing, so ``json``'s
  recursive decoder never runs out of stack on ``[[[[…`` a hundred thousand deep);
- ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON; PostgreSQL's jsonb refuses them) and numbers
  that overflow a float (``1e400``);
- integers outside 64-bit signed (PostgreSQL's bigint; also keeps ``int()`` away from Python's
  4,300-digit limit, and every integer convertible to a float);
- lone UTF-16 surrogates (``"\\ud800"``): no UTF-8 encoding exists, so neither the database nor
  the JSON renderer can write them;
- with ``allow_nul=False``, NUL characters, which PostgreSQL text and jsonb cannot hold.

``parse_int`` reads an integer written as text outside JSON (a path segment, a query
parameter) by the same 64-bit bound; ``storable`` says whether an id from outside JSON (a path)
can reach the database at all.

``check`` applies the same rules to a value that did not come from text (rows a generator
produced, a form's parsed field), naming the path instead of a position.

``loads_lenient`` is for JSON that is read, not stored (model output, tool-call arguments, a stored
trajectory's messages): ``json.loads``'s own rules, but what ``json.loads`` cannot hold (an integer
past Python's 4,300-digit limit, nesting past the recursion limit) is ordinary bad JSON, a
``json.JSONDecodeError``, instead of a ValueError or RecursionError no caller expects.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

MAX_DEPTH = 64
# Far deeper than any real tool call, far enough below the recursion limit (json's decoder and the
# indenting encoder recurse once per level) that the frames below the caller never matter.
LENIENT_MAX_DEPTH = 512
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
_INT_DIGITS = len(str(INT_MIN))  # longer strings are out of range without converting them

_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string, escapes included
_STRINGS = re.compile(_STRING)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STRUCTURE = re.compile(_STRING + r"|[\[\]{}]")  # a string or one bracket, for the exact scan
# What can be refused: strings and the number-like tokens (used only to locate a refusal).
_TOKENS = re.compile(_STRING + r"|-?Infinity|NaN|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Cheap pre-checks on the raw text: without a match, no decoded string can hold a refused character.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_NUL_ESCAPE = "\\u0000"


class JSONError(ValueError):
    """Refused JSON. ``position`` is the character offset in the text (``loads``; a byte offset for
    bytes that are not UTF-8), ``path`` the place in the value (``check``)."""

    def __init__(self, message: str, position: int | None = None, *, text: str = "", path: str = "") -> None:
        self.message = message
        self.position = position
        self.path = path
        self.line = self.column = None
        where = ""
        if position is not None:
            self.line = text.count("\n", 0, position) + 1
            self.column = position - (text.rfind("\n", 0, position) + 1) + 1
            where = f" at line {self.line} column {self.column} (char {position})"
        elif path:
            where = f" at {path}"
        super().__init__(message + where)


class _Refused(Exception):
    def __init__(self, message: str) -> None:
        self.message = message


def _number_problem(token: str) -> str | None:
    if token in ("NaN", "Infinity", "-Infinity"):
        return f"{token} is not a JSON number"
    if "." in token or "e" in token or "E" in token:
        return None if math.isfinite(float(token)) else "number too large for a float"
    if len(token) > _INT_DIGITS or not INT_MIN <= int(token) <= INT_MAX:
        return "integer out of range (64-bit signed)"
    return None


def _string_problem(value: str, allow_nul: bool) -> str | None:
    if _SURROGATE.search(value):
        return "lone UTF-16 surrogate in a string (no UTF-8 encoding exists)"
    if not allow_nul and "\x00" in value:
        return "NUL character in a string (cannot be stored)"
    return None


def _parse_int(token: str) -> int:
    problem = _number_problem(token)
    if problem:
        raise _Refused(problem)
    return int(token)


def _parse_float(token: str) -> float:
    problem = _number_problem(token)
    if problem:
        raise _Refused(problem)
    return float(token)


def _parse_constant(token: str) -> Any:
    raise _Refused(f"{token} is not a JSON number")


def _check_depth(text: str, max_depth: int) -> None:
    if text.count("[") + text.count("{") <= max_depth:
        return
    # Fast path, all in C: keep only the brackets outside strings, then strip innermost pairs; each
    # pass lowers the depth by at least one, so max_depth passes empty any document within the limit.
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    for _ in range(max_depth):
        shorter = brackets.replace("[]", "").replace("{}", "")
        if not shorter:
            return
        if shorter == brackets:
            break  # mismatched brackets: the exact scan below, then json, say where
        brackets = shorter
    depth = 0
    for match in _STRUCTURE.finditer(text):
        token = match.group()
        if token == "[" or token == "{":
            depth += 1
            if depth > max_depth:
                raise JSONError(f"nested deeper than {max_depth} levels", match.start(), text=text)
        elif token == "]" or token == "}":
            depth -= 1


def _locate(text: str, message: str, allow_nul: bool) -> int | None:
    """Where the first refused token is (only on the error path: a second scan is fine there)."""
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token.startswith('"'):
            try:
                decoded = json.loads(token)
            except ValueError:
                continue
            if _string_problem(decoded, allow_nul):
                return match.start()
        elif _number_problem(token) == message:
            return match.start()
    return None


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH, allow_nul: bool = True) -> Any:
    """``json.loads`` with the rules above; raises JSONError naming the position."""
    if isinstance(text, bytes | bytearray):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONError("not UTF-8 text", exc.start) from None
    _check_depth(text, max_depth)
    try:
        value = json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
        )
    except json.JSONDecodeError as exc:
        raise JSONError(exc.msg, exc.pos, text=text) from None
    except _Refused as refused:
        raise JSONError(refused.message, _locate(text, refused.message, allow_nul), text=text) from None
    suspicious = _SURROGATE_ESCAPE.search(text) or _SURROGATE.search(text)
    if suspicious or (not allow_nul and (_NUL_ESCAPE in text or "\x00" in text)):
        problem = _first_problem(value, max_depth, allow_nul)
        if problem is not None:
            message, _ = problem
            raise JSONError(message, _locate(text, message, allow_nul), text=text)
    return value


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines text: split on ``\\n`` only (a trailing ``\\r`` dropped), as the
    format says. Not ``str.splitlines()``, which also splits on U+2028, U+2029 and U+0085:
    characters a JSON string may hold unescaped, so a valid row holding one would be refused as two
    broken lines."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no new one
    return [line.removesuffix("\r") for line in lines]


def storable(text: str) -> bool:
    """Whether ``text`` (an id from a path, a model name) can reach a database at all: no NUL
    (PostgreSQL refuses it even in a comparison) and no lone surrogate (no UTF-8 encoding)."""
    return "\x00" not in text and _SURROGATE.search(text) is None


def parse_int(text: str, *, low: int = INT_MIN, high: int = INT_MAX) -> int | None:
    """``text`` (a step in a path, a query parameter, a number-like string in metadata) as an
    integer in ``[low, high]``, or None: plain ASCII digits only, an optional leading ``-``, never
    more digits than 64 bits hold, so ``int()`` never meets Python's 4,300-digit limit, a Unicode
    digit such as ``²`` (``"²".isdigit()`` is true, ``int("²")`` fails) or a value the database
    refuses."""
    digits = text[1:] if text[:1] == "-" else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > _INT_DIGITS:
        return None
    value = int(text)
    return value if low <= value <= high else None


def loads_lenient(text: str, *, max_depth: int = LENIENT_MAX_DEPTH) -> Any:
    """``json.loads`` for text that is read, not stored: NaN, any integer and any float are kept as
    ``json.loads`` keeps them. What it cannot hold raises ``json.JSONDecodeError`` like any other
    malformed text, so a caller's ``except json.JSONDecodeError`` covers it."""
    if not isinstance(text, str):  # what json.loads raises for a value that is not text
        raise TypeError(f"the JSON object must be str, not {type(text).__name__}")
    try:
        _check_depth(text, max_depth)
    except JSONError as refused:
        raise json.JSONDecodeError(refused.message, text, refused.position or 0) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise  # already ordinary bad JSON (and a ValueError, so it must not reach the clause below)
    except ValueError:  # int() refusing more digits than sys.get_int_max_str_digits()
        message, position = _long_integer(text)
        raise json.JSONDecodeError(message, text, position) from None
    except RecursionError:  # the caller was already deep in its own stack
        raise json.JSONDecodeError("nested too deeply to read", text, 0) from None


def _long_integer(text: str) -> tuple[str, int]:
    limit = sys.get_int_max_str_digits()
    for match in _TOKENS.finditer(text):
        token = match.group()
        digits = token.lstrip("-")
        if digits.isdigit() and len(digits) > limit:
            return f"integer too long (more than {limit} digits)", match.start()
    return "integer too long", 0


def check(value: Any, *, max_depth: int = MAX_DEPTH, allow_nul: bool = False, path: str = "") -> None:
    """The same rules for an already-decoded value; raises JSONError naming the path."""
    problem = _first_problem(value, max_depth, allow_nul, path)
    if problem is not None:
        message, where = problem
        raise JSONError(message, path=where)


def _first_problem(value: Any, max_depth: int, allow_nul: bool, path: str = "") -> tuple[str, str] | None:
    """The first refused thing in ``value`` and its path, walking with an explicit stack (no
    recursion, so a deep value cannot exhaust Python's)."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                return f"nested deeper than {max_depth} levels", where
            if isinstance(item, dict):
                for key, child in reversed(list(item.items())):
                    if isinstance(key, str) and (problem := _string_problem(key, allow_nul)):
                        return problem, where
                    stack.append((child, f"{where}.{key}" if where else str(key), depth + 1))
            else:
                for index in reversed(range(len(item))):
                    stack.append((item[index], f"{where}[{index}]", depth + 1))
        elif isinstance(item, str):
            if problem := _string_problem(item, allow_nul):
                return problem, where
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not INT_MIN <= item <= INT_MAX:
                return "integer out of range (64-bit signed)", where
        elif isinstance(item, float) and not math.isfinite(item):
            return "NaN and infinite numbers are not JSON", where
    return None
