"""`json_match` (ours): the output is JSON, optionally valid against a JSON Schema, and its fields
match the expected value, with partial credit.

    {"type": "json_match", "input": "{{sample.output_text}}", "expected": "{{item.answer}}",
     "schema": {"type": "object", "required": ["city"]}, "fields": ["city", "population"],
     "ignore_case": false, "number_tolerance": 0}

An input that is not JSON is a `sample_parse_error`. With a schema, an output that violates it gets
reward 0 (a wrong answer, not a grading failure; the first violation is in `scores`). Without
`expected`, that schema check is the whole grade (1 or 0). With `expected`, the reward is the
fraction of expected leaves that the output matches at the same path: objects and lists are walked
down to their leaves (an empty object or list is itself a leaf), so `{"a": 1, "b": [2, 3]}` has
leaves `a`, `b.0`, `b.1`. `fields` restricts the comparison to the listed dot paths. Keys the
expected value does not have are ignored. Numbers match within `number_tolerance`; a boolean only
matches a boolean; strings compare exactly, or case-insensitively with `ignore_case`.

`expected` is a literal JSON value, or a template: a template that is a single variable
(`{{item.answer}}`) yields that value as is; any other template's text is parsed as JSON.

A schema's `pattern` and `patternProperties` are matched like the regex grader's patterns (the
`regex` package with the operator's timeout, never Python's `re`, whose backtracking has no end:
training/rewards/patterns.py); `unevaluatedProperties` next to `patternProperties` is refused, as
jsonschema matches those with `re` itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GraderRuntime, Sample, Score, is_number
from training.rewards.errors import GradingError
from training.rewards.patterns import PatternError, compile_pattern, matches
from training.rewards.templates import Template, TemplateSyntaxError

MAX_INPUT_CHARS = 1_000_000
MAX_LISTED_MISMATCHES = 10

Path = tuple[str, ...]


class JsonMatchGrader(Grader):
    type: ClassVar[str] = "json_match"
    fields: ClassVar[dict[str, Field]] = {
        "input": Field("string", default="{{sample.output_text}}", template=True),
        "expected": Field("any"),
        "schema": Field("object"),
        "fields": Field("string_list"),
        "ignore_case": Field("boolean", default=False),
        "number_tolerance": Field("number", default=0.0),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        problems = []
        if "expected" not in spec and "schema" not in spec:
            problems.append({"path": path, "message": "needs expected, schema or both"})
        if isinstance(spec.get("expected"), str):
            try:
                Template.parse(spec["expected"])
            except TemplateSyntaxError as error:
                problems.append({"path": f"{path}.expected", "message": str(error)})
        if "schema" in spec:
            message = schema_problem(spec["schema"])
            if message:
                problems.append({"path": f"{path}.schema", "message": message})
        for index, field_path in enumerate(spec.get("fields", [])):
            if not field_path or "" in field_path.split("."):
                problems.append(
                    {"path": f"{path}.fields.{index}", "message": "must be a dot path like a.b.0"}
                )
        if spec.get("number_tolerance", 0.0) < 0:
            problems.append({"path": f"{path}.number_tolerance", "message": "must not be negative"})
        return problems

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.input = Template.parse(spec["input"])
        expected = spec.get("expected")
        self.expected_template = Template.parse(expected) if isinstance(expected, str) else None
        self.has_expected = "expected" in spec
        timeout = self.runtime.sandbox.regex_timeout_seconds
        self.validator = _validator(spec["schema"], timeout) if "schema" in spec else None
        self.paths: list[Path] | None = (
            [tuple(p.split(".")) for p in spec["fields"]] if "fields" in spec else None
        )
        self.ignore_case: bool = spec["ignore_case"]
        self.tolerance: float = spec["number_tolerance"]

    def score(self, sample: Sample, item: dict[str, Any]) -> Score:
        text = self.input.render(sample, item)
        if len(text) > MAX_INPUT_CHARS:
            raise GradingError("sample_parse_error", f"input longer than {MAX_INPUT_CHARS} characters")
        try:
            output = json.loads(text)
        except ValueError as error:
            raise GradingError("sample_parse_error", f"input is not valid JSON: {error}") from None
        if self.validator is not None:
            violation = next(iter(self.validator.iter_errors(output)), None)
            if violation is not None:
                where = "/".join(str(part) for part in violation.absolute_path) or "(root)"
                return Score(
                    0.0, {"schema_valid": False, "schema_error": f"{where}: {violation.message}"[:300]}
                )
            if not self.has_expected:
                return Score(1.0, {"schema_valid": True})
        expected = self._expected(sample, item)
        leaves = self._leaves(expected)
        mismatched = [path for path, value in leaves if not self._matches(output, path, value)]
        matched = len(leaves) - len(mismatched)
        scores: dict[str, Any] = {"matched": matched, "compared": len(leaves)}
        if self.validator is not None:
            scores["schema_valid"] = True
        if mismatched:
            scores["mismatched"] = [".".join(path) or "(root)" for path in mismatched[:MAX_LISTED_MISMATCHES]]
        return Score(matched / len(leaves), scores)

    def _expected(self, sample: Sample, item: dict[str, Any]) -> Any:
        if self.expected_template is None:
            return self.spec["expected"]
        template = self.expected_template
        if len(template.parts) == 1 and isinstance(template.parts[0], tuple):
            return template.value(sample, item)
        text = template.render(sample, item)
        try:
            return json.loads(text)
        except ValueError as error:
            raise GradingError("template_error", f"expected renders to invalid JSON: {error}") from None

    def _leaves(self, expected: Any) -> list[tuple[Path, Any]]:
        if self.paths is None:
            return list(_walk(expected, ()))
        leaves = []
        for path in self.paths:
            found, value = _lookup(expected, path)
            if not found:
                raise GradingError("template_error", f"the expected value has no field {'.'.join(path)}")
            leaves.append((path, value))
        return leaves

    def _matches(self, output: Any, path: Path, expected: Any) -> bool:
        found, value = _lookup(output, path)
        if not found:
            return False
        if isinstance(expected, bool) or isinstance(value, bool):
            return isinstance(expected, bool) and isinstance(value, bool) and expected == value
        if is_number(expected) and is_number(value):
            return abs(value - expected) <= self.tolerance
        if isinstance(expected, str) and isinstance(value, str) and self.ignore_case:
            return expected.casefold() == value.casefold()
        return bool(expected == value)


def _walk(value: Any, path: Path) -> list[tuple[Path, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for key, child in value.items() for leaf in _walk(child, (*path, str(key)))]
    if isinstance(value, list) and value:
        return [leaf for index, child in enumerate(value) for leaf in _walk(child, (*path, str(index)))]
    return [(path, value)]


def _lookup(value: Any, path: Path) -> tuple[bool, Any]:
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdecimal() and len(key) < 19 and int(key) < len(value):
            value = value[int(key)]
        else:
            return False, None
    return True, value


def schema_problem(schema: dict[str, Any]) -> str | None:
    try:
        from jsonschema import exceptions, validators
    except ImportError:
        return "JSON Schema checks need the jsonschema package, which is not installed"
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        return f"invalid JSON Schema{' at ' + where if where else ''}: {error.message}"
    keywords = {keyword for keyword, _ in _schema_nodes(schema)}
    if {"patternProperties", "unevaluatedProperties"} <= keywords:
        return "unevaluatedProperties next to patternProperties is not supported (use additionalProperties)"
    for keyword, value in _schema_nodes(schema):
        patterns = [value] if keyword == "pattern" else []
        if keyword == "patternProperties" and isinstance(value, dict):
            patterns = list(value)
        # A property named "pattern" holds a schema, not a pattern: only strings are patterns.
        for pattern in (each for each in patterns if isinstance(each, str)):
            try:
                compile_pattern(pattern)
            except PatternError as error:
                return f"invalid regular expression {pattern!r} in {keyword}: {error}"
    return None


# Keywords whose values are data, not schemas: a "pattern" key inside them is not a pattern.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _schema_nodes(schema: Any) -> Iterator[tuple[str, Any]]:
    """Every (keyword, value) pair in `schema`, nested schemas included."""
    if isinstance(schema, dict):
        for keyword, value in schema.items():
            yield keyword, value
            if keyword not in DATA_KEYWORDS:
                yield from _schema_nodes(value)
    elif isinstance(schema, list):
        for element in schema:
            yield from _schema_nodes(element)


def _validator(schema: dict[str, Any], timeout_seconds: float) -> Any:
    """jsonschema's validator for `schema`, its pattern keywords matched with a timeout."""
    from jsonschema import ValidationError, validators

    base = validators.validator_for(schema)
    compiled = functools.lru_cache(maxsize=256)(compile_pattern)

    def found(pattern: str, text: str) -> bool:
        return matches(compiled(pattern), text, mode="search", timeout_seconds=timeout_seconds)

    def pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not found(pattern, instance):
            yield ValidationError(f"{instance!r} does not match {pattern!r}")

    def pattern_properties(
        validator: Any, patterns: dict[str, Any], instance: Any, schema: Any
    ) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for pattern, subschema in patterns.items():
            for key, value in instance.items():
                if found(pattern, key):
                    yield from validator.descend(value, subschema, path=key, schema_path=pattern)

    def additional_properties(
        validator: Any, allowed: Any, instance: Any, schema: dict[str, Any]
    ) -> Iterator[Any]:
        patterns = schema.get("patternProperties")
        if not patterns:  # no pattern involved: jsonschema's own
            yield from base.VALIDATORS["additionalProperties"](validator, allowed, instance, schema)
            return
        if not validator.is_type(instance, "object"):
            return
        properties = schema.get("properties", {})
        extras = sorted(
            key for key in instance if key not in properties and not any(found(p, key) for p in patterns)
        )
        if validator.is_type(allowed, "object"):
            for extra in extras:
                yield from validator.descend(instance[extra], allowed, path=extra)
        elif not allowed and extras:
            listed = ", ".join(repr(extra) for extra in extras)
            yield ValidationError(
                f"{listed} do not match any of the regexes: {', '.join(map(repr, patterns))}"
            )

    timed = {"pattern": pattern, "patternProperties": pattern_properties}
    if "additionalProperties" in base.VALIDATORS:
        timed["additionalProperties"] = additional_properties
    return validators.extend(base, timed)(schema)
