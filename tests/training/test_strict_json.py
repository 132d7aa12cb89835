"""training.rollouts.strict_json: what it refuses (with the position), what it keeps, and that a deep
document is refused by a flat scan (no recursion) in about the time json takes to parse it."""

from __future__ import annotations

import json
import time

import pytest

from training.rollouts.strict_json import (
    INT_MAX,
    INT_MIN,
    JSONError,
    check,
    jsonl_lines,
    loads,
    loads_lenient,
    parse_int,
    storable,
)


@pytest.mark.parametrize(
    ("text", "message", "position"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 64 levels", 64),
        ('{"a":' * 65 + "1" + "}" * 65, "nested deeper than 64 levels", 320),
        ('{"a": NaN}', "NaN is not a JSON number", 6),
        ("[1, Infinity]", "Infinity is not a JSON number", 4),
        ('{"x": -Infinity}', "-Infinity is not a JSON number", 6),
        ("[0, 1e400]", "number too large for a float", 4),
        ("[" + "1" * 4301 + "]", "integer out of range (64-bit signed)", 1),
        (str(INT_MAX + 1), "integer out of range (64-bit signed)", 0),
        ('["ok", "\\ud800"]', "lone UTF-16 surrogate in a string (no UTF-8 encoding exists)", 7),
        ('{"k\\udc00": 1}', "lone UTF-16 surrogate in a string (no UTF-8 encoding exists)", 1),
        ('{"a": 1,}', "Expecting property name enclosed in double quotes", 8),
    ],
)
def test_refused_with_the_position(text, message, position):
    with pytest.raises(JSONError) as refused:
        loads(text)
    assert refused.value.message == message and refused.value.position == position
    assert str(refused.value) == f"{message} at line 1 column {position + 1} (char {position})"


def test_line_and_column_count_from_one():
    with pytest.raises(JSONError) as refused:
        loads('{\n  "a": 1,\n  "b": NaN\n}')
    assert (refused.value.line, refused.value.column) == (3, 8)


def test_nul_is_refused_only_when_asked():
    assert loads('"a\\u0000b"') == "a\x00b"
    with pytest.raises(JSONError, match="NUL character"):
        loads('"a\\u0000b"', allow_nul=False)


def test_bytes_must_be_utf8():
    assert loads('{"a": "é"}'.encode()) == {"a": "é"}
    with pytest.raises(JSONError, match="not UTF-8 text") as refused:
        loads(b'{"a": "\xff"}')
    assert refused.value.position == 7


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ('"\\ud83d\\ude00"', "\U0001f600"),  # a surrogate pair is one character
        ('"\\\\ud800"', "\\ud800"),  # an escaped backslash: text, not a surrogate
        ('"' + "[" * 72 + '"', "[" * 72),  # brackets in a string do not nest
        ("[" * 64 + "]" * 64, json.loads("[" * 64 + "]" * 64)),
        (str(INT_MIN), INT_MIN),
        ("[1.5e308, -0.0, 5e-324]", [1.5e308, -0.0, 5e-324]),
    ],
)
def test_kept(text, value):
    assert loads(text) == value


def test_a_deep_document_is_refused_quickly_and_a_large_one_parses_at_json_speed():
    started = time.perf_counter()
    with pytest.raises(JSONError):
        loads("[" * 1_000_000 + "]" * 1_000_000)
    assert time.perf_counter() - started < 5
    rows = json.dumps(
        [{"messages": [{"role": "user", "content": "hi " * 20}], "item": {"a": [1, 2]}}] * 20_000
    )
    assert loads(rows) == json.loads(rows)

    def best_of_two(parse) -> float:
        times = []
        for _ in range(2):
            started = time.perf_counter()
            parse(rows)
            times.append(time.perf_counter() - started)
        return min(times)

    # Linear like json's own reader, not quadratic (which over 20k rows would take minutes): a
    # generous bound, as a loaded CI machine may pause either measurement (seen: 0.88 s against
    # json's 0.034 s once in CI; 0.10 s against 0.035 s on a quiet machine).
    plain_s, ours_s = best_of_two(json.loads), best_of_two(loads)
    assert ours_s < 30 * plain_s + 1.5, (ours_s, plain_s)


@pytest.mark.parametrize(
    ("value", "message", "path"),
    [
        ({"a": [{"b": float("nan")}]}, "NaN and infinite numbers are not JSON", "a[0].b"),
        ({"a": "\ud800"}, "lone UTF-16 surrogate in a string (no UTF-8 encoding exists)", "a"),
        ({"\udfff": 1}, "lone UTF-16 surrogate in a string (no UTF-8 encoding exists)", ""),
        ({"n": 10**30}, "integer out of range (64-bit signed)", "n"),
        ({"t": "a\x00"}, "NUL character in a string (cannot be stored)", "t"),
    ],
)
def test_check_names_the_path(value, message, path):
    with pytest.raises(JSONError) as refused:
        check(value)
    assert refused.value.message == message and refused.value.path == path


def test_check_refuses_a_deep_value_without_recursing():
    deep: list = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]
    with pytest.raises(JSONError, match="nested deeper than 64 levels"):
        check(deep)
    check({"ok": [1, 2.5, "text", None, True, {"x": [[]]}]})


@pytest.mark.parametrize(
    "text",
    ["[NaN, Infinity, -Infinity]", "[1e400]", str(10**30), '"\\ud800"', '{"a":' * 100 + "1" + "}" * 100],
)
def test_the_lenient_reader_keeps_what_json_keeps(text):
    assert repr(loads_lenient(text)) == repr(json.loads(text))


@pytest.mark.parametrize(
    ("text", "message", "position"),
    [
        ('{"a": [' + "1" * 5000 + "]}", "integer too long (more than 4300 digits)", 7),
        ("[" * 5000, "nested deeper than 512 levels", 512),
        ('{"a": 1,}', "Expecting property name enclosed in double quotes", 8),
    ],
)
def test_what_json_cannot_hold_is_ordinary_bad_json_to_the_lenient_reader(text, message, position):
    with pytest.raises(json.JSONDecodeError) as refused:
        loads_lenient(text)
    assert (refused.value.msg, refused.value.pos) == (message, position)


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("12", 12), ("-3", -3), (str(INT_MAX), INT_MAX), (str(INT_MIN), INT_MIN), (str(INT_MAX + 1), None),
     ("9" * 5000, None), ("²", None), ("١٢", None), ("+1", None), (" 1", None), ("", None), ("-", None)],
)  # fmt: skip
def test_parse_int_reads_plain_ascii_digits_within_64_bits_only(text, value):
    assert parse_int(text) == value
    assert parse_int("5", low=6) is None and parse_int("5", high=4) is None


def test_storable_refuses_nul_and_lone_surrogates_only():
    assert storable("proj/model:3") and storable("caf\u00e9 \U0001f600")
    assert not storable("a\x00b") and not storable("\ud800") and not storable("x\udfff")


def test_jsonl_lines_split_on_newline_only():
    assert jsonl_lines('{"a": "x\u2028y\u2029z\x85"}\r\n\n{"b": 1}\n') == [
        '{"a": "x\u2028y\u2029z\x85"}',
        "",
        '{"b": 1}',
    ]
    assert jsonl_lines("") == [] and jsonl_lines("x") == ["x"]
