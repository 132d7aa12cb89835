"""The loop's grading step: every trajectory gets its reward; too many failures fail the run."""

from __future__ import annotations

import pytest

from training.rewards import RewardFailure, grade_trajectories
from training.rollouts.trajectory import Trajectory
from training.runs.steps import rows_for_step


def trajectory(text: str) -> Trajectory:
    return Trajectory(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
        prompt_token_ids=[1],
        completion_token_ids=[2],
        logprobs=[-0.1],
        finish_reason="stop",
    )


ROWS = [
    {"index": 0, "data": {"prompt": "a", "item": {"answer": "4"}}},
    {"index": 1, "data": {"prompt": "b", "item": {"answer": "7"}}},
]


def test_rewards_sub_rewards_and_error_counts_are_filled_in():
    groups = [[trajectory("4"), trajectory("5")], [trajectory("7"), trajectory("7!")]]
    spec = {
        "type": "string_check",
        "name": "exact",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
    metrics = grade_trajectories(spec, groups, ROWS, max_error_fraction=0.5)
    assert [[t.reward for t in g] for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert groups[0][0].sub_rewards == {"exact": 1.0}
    assert metrics["grader_error_fraction"] == 0.0


def test_python_grader_grades_the_whole_step_in_the_sandbox():
    groups = [[trajectory("aa"), trajectory("a")], [trajectory("aaaa"), trajectory("")]]
    spec = {
        "type": "python",
        "source": "def grade(sample, item):\n    return len(sample['output_text']) / 4\n",
    }
    grade_trajectories(spec, groups, ROWS, max_error_fraction=0.5)
    assert [[t.reward for t in g] for g in groups] == [[0.5, 0.25], [1.0, 0.0]]


def test_failures_above_the_limit_fail_with_the_definition_name_and_an_example():
    groups = [[trajectory("x"), trajectory("y")], [trajectory("z"), trajectory("w")]]
    spec = {"type": "regex", "pattern": "{{item.missing}}"}
    with pytest.raises(RewardFailure) as caught:
        grade_trajectories(spec, groups, ROWS, max_error_fraction=0.5, reward_name="'mine' v3")
    message = str(caught.value)
    assert "'mine' v3" in message and "4 of 4" in message and "template_error" in message


def test_failures_below_the_limit_are_data():
    groups = [[trajectory("4"), trajectory("5")], [trajectory("7"), trajectory("8")]]
    rows = [ROWS[0], {"index": 1, "data": {"prompt": "b", "item": {}}}]  # second row lacks the answer
    spec = {
        "type": "string_check",
        "input": "{{sample.output_text}}",
        "reference": "{{item.answer}}",
        "operation": "eq",
    }
    metrics = grade_trajectories(spec, groups, rows, max_error_fraction=0.6)
    assert metrics["grader_errors"] == 2.0 and metrics["grader_errors.template_error"] == 2.0
    assert groups[1][0].errors[0]["code"] == "template_error" and groups[1][0].reward == 0.0


def test_rows_for_step_are_deterministic_per_seed_and_step():
    rows = [{"index": i, "data": {"prompt": str(i)}} for i in range(10)]
    assert rows_for_step(rows, seed=1, step=3, count=4) == rows_for_step(rows, seed=1, step=3, count=4)
    assert rows_for_step(rows, seed=1, step=3, count=4) != rows_for_step(rows, seed=1, step=4, count=4)
    assert len(rows_for_step(rows[:2], seed=0, step=1, count=5)) == 5  # with replacement when short
