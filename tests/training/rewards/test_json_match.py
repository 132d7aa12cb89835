import json
import time

import pytest

from training.rewards import GraderSpecError, Sample, SandboxConfig, build_grader, validate_grader

EXPECTED = {"city": "Paris", "population": 2100000, "tags": ["capital", "europe"], "coastal": False}


def json_match(**extra):
    return {"type": "json_match", "expected": "{{item.expected}}", **extra}


def grade(spec, output, expected=EXPECTED):
    text = output if isinstance(output, str) else json.dumps(output)
    return build_grader(spec).grade(Sample(output_text=text), {"expected": expected})


@pytest.mark.parametrize(
    ("output", "reward"),
    [
        (EXPECTED, 1.0),
        # 5 leaves: city, population, tags.0, tags.1, coastal.
        ({**EXPECTED, "population": 2000000}, 4 / 5),
        ({"city": "Paris", "tags": ["capital"]}, 2 / 5),
        ({**EXPECTED, "coastal": 0}, 4 / 5),  # 0 is not false
        ({**EXPECTED, "extra": "ignored"}, 1.0),
        ({"city": "paris"}, 0.0),
        ([], 0.0),
    ],
)
def test_partial_credit_per_expected_leaf(output, reward):
    result = grade(json_match(), output)
    assert result.errors == []
    assert result.reward == pytest.approx(reward)


def test_scores_list_what_did_not_match():
    result = grade(json_match(), {"city": "Lyon", "population": 2100000})
    assert result.scores == {
        "matched": 1,
        "compared": 5,
        "mismatched": ["city", "tags.0", "tags.1", "coastal"],
    }


def test_fields_restrict_the_comparison_and_options_loosen_it():
    spec = json_match(fields=["city", "population"], ignore_case=True, number_tolerance=100000)
    assert grade(spec, {"city": "PARIS", "population": 2050000}).reward == 1.0
    missing = grade(json_match(fields=["country"]), EXPECTED)
    assert [e["code"] for e in missing.errors] == ["template_error"]


def test_output_that_is_not_json_is_a_sample_parse_error():
    result = grade(json_match(error_reward=-1), "The city is Paris.")
    assert result.reward == -1.0
    assert [e["code"] for e in result.errors] == ["sample_parse_error"]
    assert result.to_openai_dict()["metadata"]["errors"]["sample_parse_error"] is True


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
}


def test_schema_violation_is_reward_zero_not_an_error():
    result = grade(json_match(schema=SCHEMA), {"city": "Paris", "population": -1})
    assert result.errors == []
    assert result.reward == 0.0
    assert result.scores["schema_valid"] is False
    assert "population" in result.scores["schema_error"]


def test_schema_alone_is_a_pass_fail_check():
    spec = {"type": "json_match", "schema": SCHEMA}
    assert (
        build_grader(spec).grade(Sample(output_text='{"city": "Paris", "population": 5}'), {}).reward == 1.0
    )
    assert build_grader(spec).grade(Sample(output_text='{"city": "Paris"}'), {}).reward == 0.0


def test_expected_may_be_literal_json_or_a_rendered_template():
    literal = {"type": "json_match", "expected": {"answer": 4}}
    assert build_grader(literal).grade(Sample(output_text='{"answer": 4}'), {}).reward == 1.0
    rendered = {"type": "json_match", "expected": '{"answer": {{item.answer}}}'}
    assert build_grader(rendered).grade(Sample(output_text='{"answer": 4}'), {"answer": 4}).reward == 1.0
    scalar = {"type": "json_match", "expected": "{{item.answer}}"}
    assert build_grader(scalar).grade(Sample(output_text='"four"'), {"answer": "four"}).reward == 1.0


def test_spec_problems():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader({"type": "json_match", "fields": ["a..b"], "number_tolerance": -1})
    assert {p["path"] for p in caught.value.problems} == {
        "grader",
        "grader.fields.0",
        "grader.number_tolerance",
    }
    with pytest.raises(GraderSpecError) as caught:
        validate_grader({"type": "json_match", "schema": {"type": "objekt"}})
    [problem] = caught.value.problems
    assert problem["path"] == "grader.schema" and "invalid JSON Schema" in problem["message"]


# --- schema patterns (issue 51): matched with a timeout, never by Python's re ------------------------

QUICK = SandboxConfig(regex_timeout_seconds=0.3)
EVIL = "^(a|a)+$"  # exponential in `re` and `regex` alike; `re` holds the GIL for hours on 41 characters


@pytest.mark.parametrize(
    ("schema", "output"),
    [
        ({"type": "string", "pattern": EVIL}, "a" * 40 + "b"),
        ({"type": "object", "patternProperties": {EVIL: {}}}, {"a" * 40 + "b": 1}),
        (
            {"type": "object", "patternProperties": {EVIL: {}}, "additionalProperties": False},
            {"a" * 40 + "b": 1},
        ),
        ({"type": "object", "propertyNames": {"pattern": EVIL}}, {"a" * 40 + "b": 1}),
    ],
)
def test_a_catastrophic_schema_pattern_is_a_regex_timeout_error(schema, output):
    grader = build_grader({"type": "json_match", "schema": schema}, sandbox=QUICK)
    started = time.process_time()  # what the timeout counts
    result = grader.grade(Sample(output_text=json.dumps(output)), {})
    assert time.process_time() - started < 1.0
    assert [error["code"] for error in result.errors] == ["regex_timeout"]


def test_schema_patterns_still_decide_validity():
    schema = {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": r"^\d{3}$"}},
        "patternProperties": {"^x-": {"type": "integer"}},
        "additionalProperties": False,
    }
    spec = {"type": "json_match", "schema": schema}
    assert grade(spec, {"id": "123", "x-a": 1}).reward == 1.0
    wrong_id, wrong_extra, extra = (
        grade(spec, {"id": "12"}),
        grade(spec, {"id": "123", "x-a": "one"}),
        grade(spec, {"id": "123", "y": 1}),
    )
    assert [r.reward for r in (wrong_id, wrong_extra, extra)] == [0.0, 0.0, 0.0]
    assert "does not match" in wrong_id.scores["schema_error"]
    assert "'y' do not match any of the regexes" in extra.scores["schema_error"]
    assert not any(r.errors for r in (wrong_id, wrong_extra, extra))


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "string", "pattern": "x{4294967294}"}, "repeats too large"),
        ({"properties": {"a": {"patternProperties": {"(a{1000}){1000}": {}}}}}, "repeats too large"),
        ({"patternProperties": {"^a": {}}, "unevaluatedProperties": False}, "not supported"),
    ],
)
def test_schema_patterns_that_cannot_be_matched_safely_are_refused(schema, message):
    with pytest.raises(GraderSpecError, match=message):
        validate_grader({"type": "json_match", "schema": schema})


def test_a_property_named_pattern_is_not_a_pattern():
    schema = {
        "properties": {"pattern": {"type": "string"}, "patternProperties": True},
        "const": {"pattern": 1},
    }
    validate_grader({"type": "json_match", "schema": schema})
