"""score_model and label_model against a real local OpenAI-compatible server with scripted replies."""

import time

import pytest

from training.rewards import (
    GraderSetupError,
    GraderSpecError,
    Sample,
    build_grader,
    grade_many,
    validate_grader,
)
from training.rewards.score_model import parse_score

from .conftest import completion

SCORE = {
    "type": "score_model",
    "name": "judge",
    "model": "gpt-4o-mini",
    "input": [
        {"role": "developer", "content": "Score the answer from 0 to 1. Reply with the number only."},
        {"role": "user", "content": "Reference: {{item.answer}}\nAnswer: {{sample.output_text}}"},
    ],
    "range": [0, 1],
    "sampling_params": {"temperature": 0, "seed": 7, "max_completions_tokens": 16},
}
LABEL = {
    "type": "label_model",
    "name": "tone",
    "model": "gpt-4o-mini",
    "input": [{"role": "user", "content": "Polite or rude? {{sample.output_text}}"}],
    "labels": ["polite", "rude"],
    "passing_labels": ["polite"],
}


def judged(server, spec, reply, output="Paris", item=None, **client):
    server.reply = lambda body: reply if isinstance(reply, tuple) else completion(reply)
    grader = build_grader(spec, judge=server.client(**client))
    return grader.grade(Sample(output_text=output), item or {"answer": "Paris"})


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("1", 1.0),
        ("0.25", 0.25),
        (" 0.5. ", 0.5),
        ('{"score": 0.75, "reason": "close"}', 0.75),
        ('Sure.\n```json\n{"result": 0.4}\n```', 0.4),
        ("The answer matches the reference. Score: 0.9", 0.9),
        ("0", 0.0),
    ],
)
def test_score_model_reads_the_judges_number(judge_server, reply, reward):
    result = judged(judge_server, SCORE, reply)
    assert result.errors == []
    assert result.reward == reward
    assert result.scores == {"score": reward}


def test_score_model_sends_rendered_messages_params_and_key(judge_server):
    result = judged(judge_server, SCORE, "1")
    [body] = judge_server.requests
    assert body["model"] == "gpt-4o-mini"
    assert body["messages"] == [
        {"role": "system", "content": "Score the answer from 0 to 1. Reply with the number only."},
        {"role": "user", "content": "Reference: Paris\nAnswer: Paris"},
    ]
    assert (body["temperature"], body["seed"], body["max_completion_tokens"]) == (0, 7, 16)
    assert judge_server.headers[0]["Authorization"] == "Bearer sk-test-key"
    assert result.token_usage == {
        "judge-1": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    }
    assert result.sampled_model_name == "judge-1"
    openai = result.to_openai_dict()
    assert openai["metadata"]["token_usage"] == 12
    assert openai["model_grader_token_usage_per_model"] == {"judge-1": result.token_usage["judge-1"]}


def test_client_model_override_replaces_the_spec_model(judge_server):
    judged(judge_server, SCORE, "1", model="our-project/judge:latest")
    assert judge_server.requests[0]["model"] == "our-project/judge:latest"


def test_pass_threshold_turns_the_score_into_pass_or_fail(judge_server):
    spec = {**SCORE, "range": [1, 10], "pass_threshold": 7}
    assert judged(judge_server, spec, "7").reward == 1.0
    low = judged(judge_server, spec, "6.5")
    assert low.reward == 0.0 and low.scores == {"score": 6.5}


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        ("The answer looks fine to me.", "no score"),
        ('{"verdict": "good"}', "no score"),
        ("1.5", "outside the range [0, 1]"),
        ("-0.2", "outside the range [0, 1]"),
        ('{"score": 7}', "outside the range [0, 1]"),
    ],
)
def test_malformed_or_out_of_range_scores_are_parse_errors(judge_server, reply, detail):
    result = judged(judge_server, {**SCORE, "error_reward": -1}, reply)
    assert result.reward == -1.0
    [error] = result.errors
    assert (error["code"], error["grader"]) == ("model_grader_parse_error", "judge")
    assert detail in error["detail"]
    # The tokens were spent all the same.
    assert result.token_usage["judge-1"]["total_tokens"] == 12
    flags = result.to_openai_dict()["metadata"]["errors"]
    assert flags["model_grader_parse_error"] and not flags["model_grader_refusal_error"]


@pytest.mark.parametrize(
    "reply",
    [
        completion(None, refusal="I can't help with grading this."),
        completion("I'm sorry, but I cannot evaluate this content."),
        completion("", finish_reason="content_filter"),
    ],
)
def test_refusals_are_parse_errors_flagged_as_refusals(judge_server, reply):
    judge_server.reply = lambda body: reply
    result = build_grader(SCORE, judge=judge_server.client()).grade(Sample(output_text="x"), {"answer": "y"})
    [error] = result.errors
    assert error["code"] == "model_grader_parse_error"
    assert error["detail"].startswith("refusal")
    flags = result.to_openai_dict()["metadata"]["errors"]
    assert flags["model_grader_parse_error"] and flags["model_grader_refusal_error"]


def test_server_errors_and_unreachable_judges_are_server_errors(judge_server):
    result = judged(judge_server, SCORE, (500, '{"error": {"message": "overloaded"}}'))
    [error] = result.errors
    assert error["code"] == "model_grader_server_error"
    assert "HTTP 500" in error["detail"] and "overloaded" in error["detail"]
    assert "sk-test-key" not in error["detail"]
    assert (
        judged(judge_server, SCORE, (200, "<html>oops</html>")).errors[0]["code"]
        == "model_grader_server_error"
    )
    assert (
        judged(judge_server, SCORE, (200, '{"choices": []}')).errors[0]["code"] == "model_grader_server_error"
    )
    unreachable = build_grader(SCORE, judge=judge_server.client(base_url="http://127.0.0.1:9/v1"))
    down = unreachable.grade(Sample(output_text="x"), {"answer": "y"})
    assert down.errors[0]["code"] == "model_grader_server_error"
    assert "unreachable" in down.errors[0]["detail"]
    assert down.to_openai_dict()["metadata"]["errors"]["model_grader_server_error_details"]


def test_redirects_are_refused_so_the_key_stays_with_the_configured_endpoint(judge_server):
    elsewhere = {"Location": judge_server.url.replace("/v1", "/elsewhere/v1") + "/chat/completions"}
    result = judged(judge_server, SCORE, (307, "moved", elsewhere))
    assert result.errors[0]["code"] == "model_grader_server_error"
    assert "HTTP 307" in result.errors[0]["detail"]
    assert len(judge_server.requests) == 1
    assert "sk-test-key" not in repr(judge_server.client())


def test_transient_errors_are_retried(judge_server):
    answers = iter([(503, "busy"), completion("0.5")])
    judge_server.reply = lambda body: next(answers)
    grader = build_grader(SCORE, judge=judge_server.client(retries=1, retry_backoff=0.01))
    result = grader.grade(Sample(output_text="x"), {"answer": "y"})
    assert result.errors == [] and result.reward == 0.5
    assert len(judge_server.requests) == 2


def test_a_slow_judge_times_out_as_a_server_error(judge_server):
    def slow(body):
        time.sleep(1.0)
        return completion("1")

    judge_server.reply = slow
    grader = build_grader(SCORE, judge=judge_server.client(timeout=0.2))
    result = grader.grade(Sample(output_text="x"), {"answer": "y"})
    assert result.errors[0]["code"] == "model_grader_server_error"
    assert "did not answer within 0.2 s" in result.errors[0]["detail"]


def test_a_batch_is_judged_concurrently_and_in_order(judge_server):
    def reply(body):
        time.sleep(0.2)
        answer = judge_server.user_text(body).rsplit("Answer: ", 1)[1]
        return completion("1" if answer == "Paris" else "0")

    judge_server.reply = reply
    grader = build_grader(SCORE, judge=judge_server.client(max_concurrency=4))
    outputs = ["Paris", "Lyon", "Paris", "Nice"]
    started = time.perf_counter()
    results = grade_many(grader, [Sample(output_text=o) for o in outputs], [{"answer": "Paris"}] * 4)
    assert time.perf_counter() - started < 0.6  # four 0.2 s calls, not in series
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("reply", "label", "reward"),
    [
        ("polite", "polite", 1.0),
        ("Rude.", "rude", 0.0),
        ('{"label": "POLITE"}', "polite", 1.0),
        ("The reply is clearly rude in tone.", "rude", 0.0),
    ],
)
def test_label_model_rewards_passing_labels(judge_server, reply, label, reward):
    result = judged(judge_server, LABEL, reply, output="Thanks so much!")
    assert result.errors == []
    assert (result.reward, result.scores) == (reward, {"label": label})


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        ("It is somewhat polite but also rude.", "several labels"),
        ("neutral", "no label"),
        ('{"label": "neutral"}', "not one of"),
        ("I'm sorry, I can't classify this.", "refusal"),
    ],
)
def test_label_model_unreadable_labels_are_parse_errors(judge_server, reply, detail):
    result = judged(judge_server, LABEL, reply, output="hm")
    [error] = result.errors
    assert error["code"] == "model_grader_parse_error"
    assert detail in error["detail"]


def test_judge_graders_need_a_judge_to_be_built_but_not_to_be_validated():
    validate_grader(SCORE)
    validate_grader(LABEL)
    with pytest.raises(GraderSetupError, match="score_model grader 'judge' needs a judge endpoint"):
        build_grader(SCORE)


def test_judge_spec_problems_have_paths():
    spec = {
        **SCORE,
        "input": [{"role": "robot", "content": 3}, "hi", {"role": "user", "content": "{{item.x"}],
        "range": [1, 0],
        "sampling_params": {"temperature": "hot", "top_k": 5},
    }
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    assert {problem["path"] for problem in caught.value.problems} == {
        "grader.input.0.role",
        "grader.input.0.content",
        "grader.input.1",
        "grader.input.2.content",
        "grader.range",
        "grader.sampling_params.temperature",
        "grader.sampling_params.top_k",
    }
    bad_labels = {**LABEL, "labels": ["yes", "YES"], "passing_labels": ["maybe"]}
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(bad_labels)
    assert {problem["path"] for problem in caught.value.problems} == {
        "grader.labels",
        "grader.passing_labels.0",
    }


def test_parse_score_ignores_numbers_that_are_not_a_score():
    assert parse_score("The capital has 2 million people.") is None
    assert parse_score("true") is None
    assert parse_score('{"score": "0.3"}') == 0.3
    assert parse_score("Rating: **8**") == 8.0
