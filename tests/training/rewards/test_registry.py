import subprocess
import sys
from pathlib import Path

import pytest

from training.rewards import (
    GRADER_TYPES,
    GradeResult,
    GraderSpecError,
    Sample,
    build_grader,
    grade,
    grade_group,
    grade_many,
    validate_grader,
)

EXACT = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


ALL_TYPES = "string_check, text_similarity, regex, json_match, tool_call, python, score_model, label_model, multi, ruler, environment, endpoint"


def test_registry_maps_type_names_to_grader_classes():
    assert list(GRADER_TYPES) == ALL_TYPES.split(", ")
    assert all(cls.type == name for name, cls in GRADER_TYPES.items())
    assert [name for name, cls in GRADER_TYPES.items() if cls.grades_groups] == ["ruler"]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ([], "grader: must be an object"),
        ({"input": "x"}, "grader.type: is required"),
        ({"type": "cosine"}, f"grader.type: must be one of {ALL_TYPES}"),
        ({"type": ["regex"]}, f"grader.type: must be one of {ALL_TYPES}"),
    ],
)
def test_unusable_specs_are_rejected(spec, expected):
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    assert str(caught.value) == expected
    assert isinstance(caught.value, ValueError)


def test_error_reward_must_be_a_number():
    with pytest.raises(GraderSpecError, match="grader.error_reward: must be a finite number"):
        build_grader({**EXACT, "error_reward": "low"})
    with pytest.raises(GraderSpecError, match="grader.error_reward"):
        build_grader({**EXACT, "error_reward": float("nan")})


def test_grade_accepts_a_spec_or_a_built_grader():
    sample, item = Sample(output_text="4"), {"answer": "4"}
    assert grade(EXACT, sample, item).reward == 1.0
    assert grade(build_grader({**EXACT, "name": "exact"}), sample, item).sub_rewards == {"exact": 1.0}


def test_grade_many_pairs_samples_with_items_in_order():
    samples = [Sample(output_text=text) for text in ["a", "b", "c"]]
    items = [{"answer": "a"}, {"answer": "x"}, {}]
    results = grade_many(build_grader(EXACT), samples, items)
    assert [result.reward for result in results] == [1.0, 0.0, 0.0]
    assert [len(result.errors) for result in results] == [0, 0, 1]
    assert grade_many(EXACT, samples[:1], items[:1])[0].reward == 1.0


def test_grade_many_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 samples but 1 items"):
        grade_many(EXACT, [Sample(output_text="a")] * 2, [{}])


def test_result_records_time_and_serialises():
    result = grade(EXACT, Sample(output_text="4"), {})
    assert isinstance(result, GradeResult)
    assert 0.0 < result.execution_time < 1.0
    data = result.to_dict()
    assert data["reward"] == 0.0
    assert data["sub_rewards"] == {"string_check": 0.0}
    assert data["errors"][0]["code"] == "template_error"
    assert set(data) == {
        "reward",
        "sub_rewards",
        "errors",
        "execution_time",
        "name",
        "type",
        "scores",
        "token_usage",
        "sampled_model_name",
    }


def test_openai_shaped_result():
    result = grade({**EXACT, "name": "exact"}, Sample(output_text="4"), {})
    data = result.to_openai_dict()
    assert set(data) == {"reward", "sub_rewards", "metadata", "model_grader_token_usage_per_model"}
    metadata = data["metadata"]
    assert (metadata["name"], metadata["type"]) == ("exact", "string_check")
    assert metadata["token_usage"] is None and metadata["sampled_model_name"] is None
    assert metadata["errors"]["invalid_variable_error"] is True
    assert not any(value for key, value in metadata["errors"].items() if key != "invalid_variable_error")
    assert metadata["error_details"] == [
        {"code": "template_error", "detail": "item.answer not found (no 'answer')", "grader": "exact"}
    ]
    assert set(metadata["errors"]) == {
        "formula_parse_error",
        "sample_parse_error",
        "truncated_observation_error",
        "unresponsive_reward_error",
        "invalid_variable_error",
        "other_error",
        "python_grader_server_error",
        "python_grader_server_error_type",
        "python_grader_runtime_error",
        "python_grader_runtime_error_details",
        "model_grader_server_error",
        "model_grader_refusal_error",
        "model_grader_parse_error",
        "model_grader_server_error_details",
    }


def test_grade_group_takes_one_item_or_one_per_sample():
    samples = [Sample(output_text=text) for text in ["4", "5"]]
    assert [r.reward for r in grade_group(EXACT, samples, {"answer": "4"})] == [1.0, 0.0]
    assert [r.reward for r in grade_group(EXACT, samples, [{"answer": "4"}, {"answer": "5"}])] == [1.0, 1.0]
    with pytest.raises(ValueError, match="2 samples but 1 items"):
        grade_group(EXACT, samples, [{"answer": "4"}])


def test_a_bug_in_a_grader_is_error_data_not_a_crash(monkeypatch):
    grader = build_grader(EXACT)
    monkeypatch.setattr(grader, "score", lambda sample, item: 1 / 0)
    result = grader.grade(Sample(output_text="4"), {"answer": "4"})
    assert result.errors[0]["code"] == "grader_internal_error"
    assert "ZeroDivisionError" in result.errors[0]["detail"]


def test_sample_reads_tool_calls_from_messages_when_none_are_given():
    messages = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "done", "tool_calls": [{"name": "g", "arguments": {"x": 1}}]},
    ]
    assert Sample(output_text="done", messages=messages).output_tools == [
        {"name": "f", "arguments": "{}"},
        {"name": "g", "arguments": {"x": 1}},
    ]
    given = [{"name": "h", "arguments": {}}]
    assert Sample(output_text="", messages=messages, output_tools=given).output_tools == given


def test_training_rewards_does_not_import_django():
    # A fresh interpreter: in this one pytest-django may already have imported Django.
    code = "import sys, training.rewards; assert 'django' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])
