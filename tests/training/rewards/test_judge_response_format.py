"""The judge graders ask for JSON through `response_format` (ruler always, score_model when its
spec says so) and still work with endpoints that refuse the field: against the local scripted judge."""

import json

import jsonschema

from training.rewards import Sample, build_grader, grade_group

from .conftest import completion
from .test_judges import SCORE
from .test_ruler import RULER, group, scores_reply


def refusing_response_format(reply):
    """A judge that answers 400 to any request carrying response_format, like an older server."""

    def answer(body):
        if "response_format" in body:
            return 400, json.dumps(
                {"error": {"message": "Unrecognized request argument supplied: response_format"}}
            )
        return reply

    return answer


def test_ruler_sends_its_reply_schema_as_a_strict_json_schema(judge_server):
    judge_server.reply = lambda body: scores_reply((1, 0.9), (2, 0.1), (3, 0.4))
    results = grade_group(
        build_grader(RULER, judge=judge_server.client()), group("a", "b", "c"), {"answer": "a"}
    )
    assert [r.reward for r in results] == [0.9, 0.1, 0.4]
    [request] = judge_server.requests
    response_format = request["response_format"]
    assert response_format["type"] == "json_schema" and response_format["json_schema"]["strict"] is True
    schema = response_format["json_schema"]["schema"]
    # The judge's well-formed reply fits it; one with a wrong id count or a score past 1 does not.
    good = json.loads(scores_reply((1, 0.9), (2, 0.1), (3, 0.4))["choices"][0]["message"]["content"])
    jsonschema.validate(good, schema)
    for bad in (
        {"scores": good["scores"][:2]},
        {"scores": [*good["scores"][:2], {**good["scores"][2], "score": 1.5}]},
        {"scores": [*good["scores"][:2], {**good["scores"][2], "trajectory_id": "4"}]},
    ):
        assert not jsonschema.Draft202012Validator(schema).is_valid(bad)


def test_a_judge_that_refuses_response_format_is_asked_without_it_and_remembered(judge_server):
    judge_server.reply = refusing_response_format(scores_reply((1, 0.7), (2, 0.2)))
    grader = build_grader(RULER, judge=judge_server.client())
    first = grade_group(grader, group("a", "b"), {"answer": "a"})
    assert [r.reward for r in first] == [0.7, 0.2] and all(r.errors == [] for r in first)
    assert ["response_format" in body for body in judge_server.requests] == [True, False]
    grade_group(grader, group("a", "b"), {"answer": "a"})
    assert len(judge_server.requests) == 3  # the next group goes plain at once


def test_a_bad_request_that_is_not_about_the_format_stays_a_server_error(judge_server):
    judge_server.reply = lambda body: (400, json.dumps({"error": {"message": "messages too long"}}))
    results = grade_group(build_grader(RULER, judge=judge_server.client()), group("a", "b"), {"answer": "a"})
    assert [r.errors[0]["code"] for r in results] == ["model_grader_server_error"] * 2
    assert len(judge_server.requests) == 2  # asked plain once, in case it was the format


def test_score_model_asks_for_a_json_score_in_its_range_only_when_told(judge_server):
    judge_server.reply = lambda body: completion('{"score": 4}')
    plain = build_grader({**SCORE, "range": [0, 5]}, judge=judge_server.client())
    assert plain.grade(Sample(output_text="Paris"), {"answer": "Paris"}).reward == 4
    assert "response_format" not in judge_server.requests[-1]  # the default is free text, as before

    asking = build_grader(
        {**SCORE, "range": [0, 5], "response_format": "json_schema"}, judge=judge_server.client()
    )
    assert asking.grade(Sample(output_text="Paris"), {"answer": "Paris"}).reward == 4
    schema = judge_server.requests[-1]["response_format"]["json_schema"]["schema"]
    jsonschema.validate({"score": 4}, schema)
    assert not jsonschema.Draft202012Validator(schema).is_valid({"score": 6})


def test_score_model_response_format_must_be_text_or_json_schema():
    from training.rewards import GraderSpecError, validate_grader

    try:
        validate_grader({**SCORE, "response_format": "xml"})
    except GraderSpecError as error:
        assert any(problem["path"].endswith("response_format") for problem in error.problems)
    else:
        raise AssertionError("response_format 'xml' was accepted")
