import pytest

from training.rewards import GraderSpecError, Sample, build_grader, grade, validate_grader
from training.rewards.regex import MAX_INPUT_CHARS


def regex(pattern, **extra):
    return {"type": "regex", "pattern": pattern, **extra}


@pytest.mark.parametrize(
    ("spec", "output", "reward"),
    [
        (regex(r"\d+"), "I think 42.", 1.0),
        (regex(r"\d+"), "forty-two", 0.0),
        (regex(r"\d+", mode="fullmatch"), "I think 42.", 0.0),
        (regex(r"\d+", mode="fullmatch"), "42", 1.0),
        (regex("answer"), "ANSWER", 0.0),
        (regex("answer", flags=["IGNORECASE"]), "ANSWER", 1.0),
        (regex("^b$"), "a\nb", 0.0),
        (regex("^b$", flags=["MULTILINE"]), "a\nb", 1.0),
        (regex("a.b"), "a\nb", 0.0),
        (regex("a.b", flags=["DOTALL"]), "a\nb", 1.0),
        (regex("^B.C$", flags=["IGNORECASE", "DOTALL"], mode="fullmatch"), "b\nc", 1.0),
        (regex("yes", score_on_match=0.5, score_on_miss=-0.5), "yes", 0.5),
        (regex("yes", score_on_match=0.5, score_on_miss=-0.5), "no", -0.5),
    ],
)
def test_modes_flags_and_scores(spec, output, reward):
    result = grade(spec, Sample(output_text=output), {})
    assert result.reward == reward
    assert result.errors == []


def test_pattern_template_is_rendered_per_item():
    grader = build_grader(regex("^{{item.answer}}$"))
    assert grader.grade(Sample(output_text="7"), {"answer": 7}).reward == 1.0
    assert grader.grade(Sample(output_text="17"), {"answer": 7}).reward == 0.0
    assert grader.grade(Sample(output_text="8"), {"answer": 8}).reward == 1.0


def test_template_values_are_inserted_raw_so_items_can_carry_regexes():
    grader = build_grader(regex("{{item.pattern}}", mode="fullmatch"))
    assert grader.grade(Sample(output_text="aaa"), {"pattern": "a+"}).reward == 1.0


def test_input_template_selects_what_is_matched():
    spec = regex("^ok$", input="{{sample.output_json.status}}")
    assert grade(spec, Sample(output_text='{"status": "ok"}'), {}).reward == 1.0
    assert grade(spec, Sample(output_text='{"status": "okay"}'), {}).reward == 0.0


def test_rendered_invalid_pattern_is_a_regex_error_with_error_reward():
    grader = build_grader(regex("^{{item.answer}}$", name="exact", error_reward=-1))
    result = grader.grade(Sample(output_text="x"), {"answer": "(("})
    assert result.reward == -1.0
    assert [(error["code"], error["grader"]) for error in result.errors] == [("regex_error", "exact")]
    assert "((" in result.errors[0]["detail"]


def test_bad_pattern_is_a_validation_problem_naming_the_re_error():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(regex("(unclosed"))
    [problem] = caught.value.problems
    assert problem["path"] == "grader.pattern"
    assert "missing )" in problem["message"]


def test_static_parts_of_a_templated_pattern_are_validated():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(regex("^({{item.answer}}$"))
    assert [problem["path"] for problem in caught.value.problems] == ["grader.pattern"]
    # Variables in a character class or a group are fine once a value stands in.
    validate_grader(regex("^[{{item.letters}}]+({{item.word}})$"))


def test_validation_reports_all_problems_at_once():
    spec = regex("[", flags=["IGNORECASE", "VERBOSE"], mode="match", score_on_miss="0", extra=1)
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(spec)
    paths = sorted(problem["path"] for problem in caught.value.problems)
    assert paths == [
        "grader.extra",
        "grader.flags.1",
        "grader.mode",
        "grader.pattern",
        "grader.score_on_miss",
    ]


def test_boolean_is_not_accepted_as_a_score():
    with pytest.raises(GraderSpecError, match=r"grader.score_on_match: must be a finite number"):
        validate_grader(regex("a", score_on_match=True))


def test_input_beyond_the_length_limit_is_not_searched():
    grader = build_grader(regex("needle"))
    assert grader.grade(Sample(output_text="x" * (MAX_INPUT_CHARS - 6) + "needle"), {}).reward == 1.0
    assert grader.grade(Sample(output_text="x" * MAX_INPUT_CHARS + "needle"), {}).reward == 0.0


def test_defaults_are_filled_in():
    spec = validate_grader(regex("a", score_on_match=2))
    assert spec == {
        "type": "regex",
        "name": "regex",
        "error_reward": 0.0,
        "input": "{{sample.output_text}}",
        "pattern": "a",
        "flags": [],
        "mode": "search",
        "score_on_match": 2.0,
        "score_on_miss": 0.0,
    }
