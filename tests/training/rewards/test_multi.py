import pytest

from training.rewards import GraderSpecError, Sample, build_grader, grade_many, validate_grader

from .conftest import completion

EXACT = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}
HAS_DIGIT = {"type": "regex", "pattern": r"\d"}
SHORT = {
    "type": "python",
    "source": "def grade(sample, item):\n    return 1.0 if len(sample['output_text']) <= 3 else 0.5\n",
}


def multi(graders, formula, **extra):
    return {"type": "multi", "name": "total", "graders": graders, "calculate_output": formula, **extra}


@pytest.mark.parametrize(
    ("output", "reward"),
    [
        ("42", 0.7 * 1 + 0.3 * 1),
        ("41", 0.7 * 0 + 0.3 * 1),
        ("forty-two", 0.0),
    ],
)
def test_weighted_sum_of_sub_graders(output, reward):
    grader = build_grader(multi({"exact": EXACT, "digit": HAS_DIGIT}, "0.7 * exact + 0.3 * digit"))
    result = grader.grade(Sample(output_text=output), {"answer": "42"})
    assert result.errors == []
    assert result.reward == pytest.approx(reward)
    assert set(result.sub_rewards) == {"exact", "digit"}
    assert (result.name, result.type) == ("total", "multi")


def test_sub_graders_are_batched_including_python_in_one_sandbox():
    grader = build_grader(multi({"exact": EXACT, "short": SHORT}, "exact * short + (1 - exact) * 0.1"))
    samples = [Sample(output_text=text) for text in ["42", "4242", "7"]]
    results = grade_many(grader, samples, [{"answer": "42"}, {"answer": "4242"}, {"answer": "8"}])
    assert [r.reward for r in results] == pytest.approx([1.0, 0.5, 0.1])
    assert results[1].sub_rewards == {"exact": 1.0, "short": 0.5}


def test_a_failing_sub_grader_contributes_its_error_reward_and_its_error():
    spec = multi({"exact": {**EXACT, "error_reward": -1}, "digit": HAS_DIGIT}, "exact + digit")
    result = build_grader(spec).grade(Sample(output_text="7"), {})
    assert result.reward == 0.0  # -1 + 1
    assert [(e["code"], e["grader"]) for e in result.errors] == [("template_error", "exact")]


def test_division_by_zero_is_error_data():
    spec = multi({"exact": EXACT}, "1 / exact", error_reward=-0.5)
    result = build_grader(spec).grade(Sample(output_text="no"), {"answer": "yes"})
    assert result.reward == -0.5
    assert [(e["code"], e["grader"]) for e in result.errors] == [("formula_evaluation_error", "total")]
    assert "division by zero" in result.errors[0]["detail"]
    assert result.to_openai_dict()["metadata"]["errors"]["other_error"] is True


def test_formula_is_validated_against_sub_grader_names_with_a_position():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(multi({"exact": EXACT}, "exact + exactt"))
    assert caught.value.problems == [
        {
            "path": "grader.calculate_output",
            "message": "formula_parse_error at position 8: unknown name 'exactt' (sub-graders: exact)",
        }
    ]


def test_sub_grader_problems_are_reported_with_nested_paths():
    spec = multi(
        {
            "exact": {**EXACT, "operation": "contains"},
            "max": HAS_DIGIT,
            "rank": {"type": "ruler", "model": "m"},
            "digit": {"type": "regex"},
        },
        "exact + (",
    )
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    assert {p["path"] for p in caught.value.problems} == {
        "grader.graders.exact.operation",
        "grader.graders.max",
        "grader.graders.rank.type",
        "grader.graders.digit.pattern",
        "grader.calculate_output",
    }


def test_sub_graders_are_named_by_their_keys_and_nested_multis_flatten():
    inner = multi({"a": EXACT, "b": HAS_DIGIT}, "a * b")
    spec = multi({"inner": inner, "digit": {**HAS_DIGIT, "name": "ignored"}}, "inner + digit")
    normalised = validate_grader(spec)
    assert normalised["graders"]["digit"]["name"] == "digit"
    result = build_grader(spec).grade(Sample(output_text="42"), {"answer": "42"})
    assert result.reward == 2.0
    assert result.sub_rewards == {"inner": 1.0, "inner.a": 1.0, "inner.b": 1.0, "digit": 1.0}


def test_label_model_inside_multi_records_judge_usage(judge_server):
    judge_server.reply = lambda body: completion("polite")
    label = {
        "type": "label_model",
        "model": "m",
        "input": [{"role": "user", "content": "{{sample.output_text}}"}],
        "labels": ["polite", "rude"],
        "passing_labels": ["polite"],
    }
    grader = build_grader(
        multi({"tone": label, "exact": EXACT}, "0.5 * tone + 0.5 * exact"), judge=judge_server.client()
    )
    result = grader.grade(Sample(output_text="42"), {"answer": "42"})
    assert result.reward == 1.0
    assert result.scores == {"tone.label": "polite"}
    assert result.token_usage == {
        "judge-1": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    }
