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
    grade_many,
    validate_grader,
)

EXACT = {
    "type": "string_check",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def test_registry_maps_type_names_to_grader_classes():
    assert {name: cls.type for name, cls in GRADER_TYPES.items()} == {
        "string_check": "string_check",
        "regex": "regex",
    }


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ([], "grader: must be an object"),
        ({"input": "x"}, "grader.type: is required"),
        ({"type": "python"}, "grader.type: must be one of string_check, regex"),
        ({"type": ["regex"]}, "grader.type: must be one of string_check, regex"),
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
    assert set(data) == {"reward", "sub_rewards", "errors", "execution_time"}


def test_training_rewards_does_not_import_django():
    # A fresh interpreter: in this one pytest-django may already have imported Django.
    code = "import sys, training.rewards; assert 'django' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])
