import pytest

from training.rewards import GraderSpecError, Sample, build_grader, grade, validate_grader


def string_check(operation, reference="{{item.answer}}", **extra):
    return {
        "type": "string_check",
        "input": "{{sample.output_text}}",
        "reference": reference,
        "operation": operation,
        **extra,
    }


@pytest.mark.parametrize(
    ("operation", "output", "answer", "reward"),
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "Paris ", "Paris", 0.0),
        ("eq", "paris", "Paris", 0.0),
        ("ne", "Paris", "Paris", 0.0),
        ("ne", "Lyon", "Paris", 1.0),
        ("like", "The answer is Paris.", "Paris", 1.0),
        ("like", "The answer is paris.", "Paris", 0.0),
        ("like", "Par", "Paris", 0.0),
        ("ilike", "THE ANSWER IS PARIS.", "Paris", 1.0),
        ("ilike", "Straße", "STRASSE", 1.0),
        ("ilike", "Lyon", "Paris", 0.0),
    ],
)
def test_operations_give_hand_checked_rewards(operation, output, answer, reward):
    result = grade(string_check(operation), Sample(output_text=output), {"answer": answer})
    assert result.reward == reward
    assert result.errors == []
    assert result.sub_rewards == {"string_check": reward}


def test_like_is_containment_not_sql_wildcards():
    result = grade(string_check("like", reference="P%s"), Sample(output_text="Paris"), {})
    assert result.reward == 0.0


def test_non_string_item_values_compare_as_json():
    spec = string_check("eq")
    assert grade(spec, Sample(output_text="42"), {"answer": 42}).reward == 1.0
    assert grade(spec, Sample(output_text="true"), {"answer": True}).reward == 1.0
    assert grade(spec, Sample(output_text="True"), {"answer": True}).reward == 0.0


def test_missing_item_key_gives_error_reward_and_names_the_path():
    grader = build_grader(string_check("eq", reference="{{item.answers.2}}", error_reward=-1))
    result = grader.grade(Sample(output_text="a"), {"answers": ["a", "b"]})
    assert result.reward == -1.0
    assert result.sub_rewards == {"string_check": -1.0}
    assert len(result.errors) == 1
    assert result.errors[0]["code"] == "template_error"
    assert "item.answers.2" in result.errors[0]["detail"]
    assert result.errors[0]["grader"] == "string_check"


def test_validation_fills_defaults():
    spec = validate_grader(string_check("eq"))
    assert spec["name"] == "string_check"
    assert spec["error_reward"] == 0.0


def test_validation_reports_unknown_operation_readably():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(string_check("contains"))
    assert str(caught.value) == "grader.operation: must be one of eq, ne, like, ilike"


def test_validation_reports_every_problem_with_its_path():
    spec = {"type": "string_check", "input": 3, "operation": "eq", "pass_threshold": 0.5, "name": None}
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    problems = {problem["path"]: problem["message"] for problem in caught.value.problems}
    assert problems == {
        "grader.pass_threshold": "unknown field (valid: error_reward, input, name, operation, reference, type)",
        "grader.name": "must be a string",
        "grader.input": "must be a string",
        "grader.reference": "is required",
    }
