"""RULER against the local scripted judge: one call per group, shared prefix sent once."""

import json
import re

import pytest

from training.rewards import (
    GraderSetupError,
    GraderSpecError,
    Sample,
    build_grader,
    grade_group,
    grade_many,
    validate_grader,
)

from .conftest import completion

RULER = {
    "type": "ruler",
    "name": "ruler",
    "model": "judge-model",
    "rubric": "Prefer the answer that names {{item.answer}}.",
    "sampling_params": {"temperature": 0},
}
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]


def group(*answers):
    return [Sample(output_text=a, messages=[*PROMPT, {"role": "assistant", "content": a}]) for a in answers]


def scores_reply(*entries, wrap=None):
    body = json.dumps(
        {"scores": [{"trajectory_id": str(i), "explanation": f"#{i}", "score": s} for i, s in entries]}
    )
    return completion(wrap.format(body) if wrap else body, prompt_tokens=300, completion_tokens=40)


def judge(server, reply, samples, spec=RULER, item=None):
    server.reply = lambda body: reply
    grader = build_grader(spec, judge=server.client())
    return grade_group(grader, samples, item or {"answer": "Paris"})


def test_one_call_scores_the_whole_group(judge_server):
    results = judge(
        judge_server, scores_reply((1, 0.9), (2, 0.1), (3, 0.5)), group("Paris", "Lyon", "Paris, I think")
    )
    assert [r.reward for r in results] == [0.9, 0.1, 0.5]
    assert all(r.errors == [] for r in results)
    assert [r.scores["explanation"] for r in results] == ["#1", "#2", "#3"]
    [request] = judge_server.requests
    system, user = request["messages"]
    assert "Prefer the answer that names Paris." in system["content"]
    # The shared prompt is sent once, as context; each trajectory carries only its own answer.
    assert user["content"].count("Capital of France?") == 1
    context = re.search(r"<context>\n(.*)\n</context>", user["content"]).group(1)
    assert json.loads(context) == PROMPT
    second = re.search(r'<trajectory id="2">\n(.*)\n</trajectory>', user["content"]).group(1)
    assert json.loads(second) == [{"role": "assistant", "content": "Lyon"}]
    # The call's tokens are counted once, on the first result.
    assert results[0].token_usage == {
        "judge-1": {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340}
    }
    assert results[1].token_usage == {} and results[2].token_usage == {}


def test_fenced_and_id_keyed_replies_are_read(judge_server):
    fenced = scores_reply((1, 1.0), (2, 0.0), wrap="Here you go:\n```json\n{}\n```")
    assert [r.reward for r in judge(judge_server, fenced, group("a", "b"))] == [1.0, 0.0]
    keyed = completion(json.dumps({"scores": {"1": 0.25, "2": 0.75}}))
    assert [r.reward for r in judge(judge_server, keyed, group("a", "b"))] == [0.25, 0.75]


def test_original_reward_is_kept_as_a_metric(judge_server):
    spec = {
        **RULER,
        "original_grader": {
            "type": "string_check",
            "name": "exact",
            "input": "{{sample.output_text}}",
            "reference": "{{item.answer}}",
            "operation": "eq",
        },
    }
    results = judge(judge_server, scores_reply((1, 0.8), (2, 0.3)), group("Paris", "Lyon"), spec=spec)
    assert [r.reward for r in results] == [0.8, 0.3]
    assert results[0].sub_rewards == {"ruler": 0.8, "exact": 1.0}
    assert results[1].sub_rewards == {"ruler": 0.3, "exact": 0.0}
    assert [r.scores["original_reward"] for r in results] == [1.0, 0.0]


@pytest.mark.parametrize(
    "content",
    [
        "Trajectory 1 is best, then 2.",
        '{"scores": "1 > 2"}',
        '{"ranking": [1, 2]}',
        '{"scores": [{"trajectory_id": 1, ',
    ],
)
def test_malformed_json_flags_every_trajectory(judge_server, content):
    results = judge(judge_server, completion(content), group("a", "b"), spec={**RULER, "error_reward": -1})
    assert [r.reward for r in results] == [-1.0, -1.0]
    for result in results:
        [error] = result.errors
        assert (error["code"], error["grader"]) == ("model_grader_parse_error", "ruler")


def test_missing_ids_and_bad_scores_flag_only_those_trajectories(judge_server):
    reply = completion(
        json.dumps(
            {
                "scores": [
                    {"trajectory_id": "1", "score": 0.6},
                    {"trajectory_id": "3", "score": 1.4},
                    {"trajectory_id": "4", "score": "high"},
                    {"trajectory_id": "9", "score": 0.5},
                ]
            }
        )
    )
    results = judge(judge_server, reply, group("a", "b", "c", "d"))
    assert results[0].reward == 0.6 and results[0].errors == []
    details = [r.errors[0]["detail"] for r in results[1:]]
    assert details == [
        "the reply has no score for trajectory 2",
        "trajectory 3: score 1.4 is outside [0, 1]",
        "trajectory 4: score 'high' is not a number",
    ]
    assert all(r.errors[0]["code"] == "model_grader_parse_error" for r in results[1:])


def test_refusal_flags_the_group_as_refused(judge_server):
    results = judge(judge_server, completion(None, refusal="I can't compare these."), group("a", "b"))
    for result in results:
        assert result.errors[0]["detail"].startswith("refusal")
        assert result.to_openai_dict()["metadata"]["errors"]["model_grader_refusal_error"] is True


def test_server_failure_flags_the_group(judge_server):
    results = judge(judge_server, (502, "bad gateway"), group("a", "b"))
    assert [r.errors[0]["code"] for r in results] == ["model_grader_server_error"] * 2


def test_each_trajectory_keeps_at_least_its_last_message(judge_server):
    same = group("Paris", "Paris")
    judge(judge_server, scores_reply((1, 0.5), (2, 0.5)), same)
    user = judge_server.requests[0]["messages"][1]["content"]
    assert user.count('"content": "Paris"') == 2


def test_ruler_needs_grade_group_and_a_judge(judge_server):
    grader = build_grader(RULER, judge=judge_server.client())
    with pytest.raises(ValueError, match="call grade_group once per group"):
        grade_many(grader, group("a"), [{}])
    with pytest.raises(GraderSetupError):
        build_grader(RULER)


def test_ruler_spec_problems():
    spec = {
        **RULER,
        "rubric": "Compare with {{sample.output_text}}",
        "original_grader": {"type": "ruler", "model": "m"},
    }
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    assert {p["path"] for p in caught.value.problems} == {"grader.rubric", "grader.original_grader.type"}
    with pytest.raises(GraderSpecError) as caught:
        validate_grader({**RULER, "original_grader": {"type": "regex"}})
    assert [p["path"] for p in caught.value.problems] == ["grader.original_grader.pattern"]
    assert "A trajectory that reaches" in validate_grader({"type": "ruler", "model": "m"})["rubric"]
