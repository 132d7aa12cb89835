import json

import pytest

from training.rewards import GraderSpecError, Sample, build_grader, validate_grader

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
