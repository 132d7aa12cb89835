"""Evaluation numbers recomputed by hand for a small fixed case, and the evaluate() path with a
scripted policy and a real grader."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from training.config import TrainConfig
from training.environments import EnvironmentSpec
from training.rollouts.trajectory import Trajectory
from training.runs.evaluation import (
    EvalSample,
    aggregate,
    compare,
    evaluate,
    evaluate_during_run,
    is_evaluation_step,
    validation_rows,
    with_reference,
)


def sample(row: int, index: int, reward: float, sub: dict, side: str = "subject", errors=None, **metrics):
    return EvalSample(
        side=side,
        task_row_index=row,
        sample_index=index,
        messages=[],
        reward=reward,
        sub_rewards=sub,
        errors=errors or [],
        metrics=metrics,
    )


SUBJECT = [
    sample(0, 0, 1.0, {"exact": 1.0, "brief": 1.0}, turns=2, tool_calls=2, tool_errors=1, tool_timeouts=0),
    sample(0, 1, 0.5, {"exact": 0.0, "brief": 1.0}, turns=1, tool_calls=0),
    sample(
        1, 0, 0.0, {"exact": 0.0}, errors=[{"code": "template_error"}], turns=3, tool_calls=2, tool_timeouts=1
    ),
    sample(1, 1, 0.25, {"exact": 0.0, "brief": 0.5}, turns=2, tool_calls=1),
]
REFERENCE = [
    sample(0, 0, 0.75, {}, side="reference"),
    sample(0, 1, 0.75, {}, side="reference"),
    sample(1, 0, 0.0, {}, side="reference"),
    sample(1, 1, 0.0, {}, side="reference"),
    sample(2, 0, 1.0, {}, side="reference"),  # a row the subject lacks: not compared
]


def test_aggregate_matches_hand_computed_values():
    result = aggregate(SUBJECT, pass_threshold=0.5)
    assert result["n"] == 4 and result["rows"] == 2
    assert result["reward_mean"] == pytest.approx((1.0 + 0.5 + 0.0 + 0.25) / 4)  # 0.4375
    # deviations 0.5625, 0.0625, -0.4375, -0.1875: squares sum to 0.546875
    assert result["reward_std"] == pytest.approx(math.sqrt(0.546875 / 4))
    assert result["pass_rate"] == 0.5  # 1.0 and 0.5 reach 0.5; 0.0 and 0.25 do not
    # exact is on every sample; brief on three of them.
    assert result["grader_means"] == pytest.approx({"brief": (1.0 + 1.0 + 0.5) / 3, "exact": 0.25})
    assert result["turns_mean"] == 2.0
    # 5 calls; one error result and one timeout failed.
    assert result["tool_calls"] == 5 and result["tool_errors"] == 2
    assert result["tool_error_rate"] == pytest.approx(0.4)
    assert result["grader_error_rate"] == 0.25
    assert result["policy_errors"] == 0


def test_aggregate_without_tool_calls_or_samples_has_no_rates():
    assert aggregate([sample(0, 0, 1.0, {})], pass_threshold=1.0)["tool_error_rate"] is None
    empty = aggregate([], pass_threshold=1.0)
    assert empty["n"] == 0 and empty["reward_mean"] is None and empty["pass_rate"] is None


def test_win_rate_counts_ties_half_on_common_rows():
    result = compare(SUBJECT, REFERENCE)
    # row 0: subject mean 0.75 vs 0.75 -> tie; row 1: 0.125 vs 0.0 -> win; row 2: reference only.
    assert (result["rows"], result["wins"], result["ties"], result["losses"]) == (2, 1, 1, 0)
    assert result["win_rate"] == pytest.approx((1 + 0.5) / 2)
    assert result["reward_delta"] == pytest.approx((0.75 + 0.125) / 2 - (0.75 + 0.0) / 2)


def test_a_losing_subject_has_win_rate_zero():
    result = compare([sample(0, 0, 0.0, {})], [sample(0, 0, 1.0, {}, side="reference")])
    assert result["win_rate"] == 0.0 and result["losses"] == 1
    assert compare([], [])["win_rate"] is None


def test_evaluation_steps_are_first_every_interval_and_last():
    steps = [s for s in range(0, 11) if is_evaluation_step(s, start_step=0, final_step=10, interval=4)]
    assert steps == [0, 4, 8, 10]
    only_ends = [s for s in range(5, 9) if is_evaluation_step(s, start_step=5, final_step=8, interval=0)]
    assert only_ends == [5, 8]


def test_validation_rows_are_the_first_by_index():
    rows = [{"index": i, "data": {}} for i in (7, 3, 9, 1)]
    assert [r["index"] for r in validation_rows(rows, 2)] == [1, 3]


class ScriptedPolicy:
    """Answers each row with scripted texts; the text "FAIL" stands for a failed rollout."""

    name = "scripted"

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    def rollout(self, rows, env, samples_per_row):
        groups = []
        for row in rows:
            group = []
            for text in self.answers[row["data"]["prompt"]][:samples_per_row]:
                trajectory = Trajectory(
                    messages=[
                        {"role": "user", "content": row["data"]["prompt"]},
                        {"role": "assistant", "content": text},
                    ],
                    prompt_token_ids=[],
                    completion_token_ids=[],
                    logprobs=[],
                    finish_reason="stop",
                    metrics={"turns": 1, "tool_calls": 0},
                )
                if text == "FAIL":
                    trajectory.metrics["policy_error"] = "endpoint answered HTTP 500"
                group.append(trajectory)
            groups.append(group)
        return groups


ROWS = [
    {"index": 4, "data": {"prompt": "two plus two", "item": {"answer": "4"}}},
    {"index": 9, "data": {"prompt": "three plus four", "item": {"answer": "7"}}},
]
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{sample.output_text}}",
    "reference": "{{item.answer}}",
    "operation": "eq",
}


def test_evaluate_grades_with_the_run_grader_and_a_failed_rollout_scores_zero():
    policy = ScriptedPolicy({"two plus two": ["4", "5"], "three plus four": ["7", "FAIL"]})
    result = evaluate(policy, ROWS, EnvironmentSpec(), EXACT, samples_per_row=2, pass_threshold=1.0)
    assert [(s.task_row_index, s.sample_index, s.reward) for s in result.samples] == [
        (4, 0, 1.0),
        (4, 1, 0.0),
        (9, 0, 1.0),
        (9, 1, 0.0),
    ]
    failed = result.samples[3]
    assert failed.errors[0]["code"] == "policy_error" and "HTTP 500" in failed.errors[0]["detail"]
    assert result.results["reward_mean"] == 0.5 and result.results["pass_rate"] == 0.5
    assert result.results["policy_errors"] == 1 and result.results["grader_means"] == {"exact": 2 / 3}
    reference = evaluate(
        ScriptedPolicy({"two plus two": ["4"], "three plus four": ["8"]}),
        ROWS,
        EnvironmentSpec(),
        EXACT,
        side="reference",
    )
    combined = with_reference(result, reference)
    # row 4: 0.5 vs 1.0 (loss); row 9: 0.5 vs 0.0 (win)
    assert combined.results["comparison"]["win_rate"] == 0.5
    assert combined.results["reference"]["reward_mean"] == 0.5
    assert {s.side for s in combined.samples} == {"subject", "reference"}


class RecordingHooks:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.evaluations: list[dict] = []

    def event(self, message, *, level="info", data=None):
        self.events.append((level, message))

    def record_evaluation(self, *, step, results, samples):
        self.evaluations.append({"step": step, "results": results, "samples": samples})


def test_run_without_validation_rows_gets_a_warning_not_a_crash():
    spec = SimpleNamespace(config=TrainConfig(), validation_rows=[], start_step=0, resume_step=None)
    hooks = RecordingHooks()
    evaluate_during_run(spec, engine=None, adapter=None, step=0, hooks=hooks)
    assert hooks.evaluations == []
    assert hooks.events and hooks.events[0][0] == "warn" and "validation" in hooks.events[0][1]
    # A fine-tuning job's events say what its API takes (validation_file; it has no fraction).
    assert "a fine-tuning job: give a validation_file" in hooks.events[0][1]


def test_eval_config_fields_are_validated():
    from training.config import ConfigError

    assert TrainConfig().eval_interval == 0 and TrainConfig().eval_max_rows == 8
    with pytest.raises(ConfigError) as caught:
        TrainConfig(eval_max_rows=0)
    assert caught.value.field == "eval_max_rows"
    with pytest.raises(ConfigError):
        TrainConfig(eval_temperature=-1.0)
