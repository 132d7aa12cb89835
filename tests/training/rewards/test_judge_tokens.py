"""A step's judge tokens: the usage each judge reply reported, summed into grade_trajectories' metrics
(training.cost); RULER's one call per group counts once, not once per trajectory."""

from __future__ import annotations

import json

from training.rewards import grade_trajectories
from training.rollouts.trajectory import Trajectory

from .conftest import completion
from .test_judges import SCORE
from .test_ruler import RULER


def episode(answer: str) -> Trajectory:
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": answer}]
    return Trajectory(messages=messages, prompt_token_ids=[1], completion_token_ids=[2, 3], logprobs=[0.0, 0.0],
                      finish_reason="stop")  # fmt: skip


ROWS = [
    {"index": 0, "data": {"item": {"answer": "Paris"}}},
    {"index": 1, "data": {"item": {"answer": "Rome"}}},
]


def test_score_model_judge_tokens_are_the_sum_of_every_replys_usage(judge_server):
    judge_server.reply = lambda body: completion("1", prompt_tokens=11, completion_tokens=3)
    groups = [[episode("Paris"), episode("Lyon")], [episode("Rome")]]
    metrics = grade_trajectories(SCORE, groups, ROWS, max_error_fraction=0.5, judge=judge_server.client())
    assert len(judge_server.requests) == 3
    assert (metrics["judge_prompt_tokens"], metrics["judge_completion_tokens"]) == (33.0, 9.0)


def test_ruler_counts_one_call_per_group_once(judge_server):
    def reply(body):
        return completion(
            json.dumps({"scores": [{"trajectory_id": str(i), "explanation": "", "score": 0.5} for i in (1, 2)]}),
            prompt_tokens=300, completion_tokens=40,
        )  # fmt: skip

    judge_server.reply = reply
    groups = [[episode("Paris"), episode("Lyon")], [episode("Rome"), episode("Milan")]]
    metrics = grade_trajectories(RULER, groups, ROWS, max_error_fraction=0.5, judge=judge_server.client())
    assert len(judge_server.requests) == 2
    assert (metrics["judge_prompt_tokens"], metrics["judge_completion_tokens"]) == (600.0, 80.0)


def test_a_grader_without_a_judge_reports_zero_judge_tokens():
    spec = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}", "operation": "eq"}  # fmt: skip
    metrics = grade_trajectories(spec, [[episode("Paris")]], ROWS[:1], max_error_fraction=0.5)
    assert (metrics["judge_prompt_tokens"], metrics["judge_completion_tokens"]) == (0.0, 0.0)
