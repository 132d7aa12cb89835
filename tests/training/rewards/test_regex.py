import threading
import time

import pytest

from training.rewards import GraderSpecError, Sample, SandboxConfig, build_grader, grade, validate_grader
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


# --- catastrophic patterns (issue 51): a timeout, the GIL released, repeats bounded ------------------

QUICK = SandboxConfig(regex_timeout_seconds=0.5)


def timed(function, *args):
    """`function(*args)`, and the process's CPU seconds it took: what the regex package's timeout
    counts (wall time may be a multiple on a crowded machine; `re` would take hours of either)."""
    started = time.process_time()
    return function(*args), time.process_time() - started


@pytest.mark.parametrize("pattern", ["^(a+)+$", "^(a|a)+$", "^(a|aa)+$"])
def test_nested_quantifiers_end_within_the_timeout(pattern):
    # In Python's `re` each takes hours on 41 characters (x2.2 a character; 26 took 3.4-5 s).
    grader = build_grader(regex(pattern, error_reward=-1), sandbox=QUICK)
    result, seconds = timed(grader.grade, Sample(output_text="a" * 40 + "b"), {})
    assert seconds < QUICK.regex_timeout_seconds + 0.3
    # `regex` answers `^(a+)+$` at once (no match); the alternations run into the timeout.
    if pattern != "^(a+)+$":
        assert [error["code"] for error in result.errors] == ["regex_timeout"]
        assert result.reward == -1.0  # the error_reward, like every grading error
        assert "0.5 s" in result.errors[0]["detail"]
        assert result.to_openai_dict()["metadata"]["errors"]["unresponsive_reward_error"] is True
    else:
        assert (result.reward, result.errors) == (0.0, [])


def test_a_templated_pattern_from_the_item_is_timed_out_too():
    grader = build_grader(regex("{{item.pattern}}"), sandbox=QUICK)
    result, seconds = timed(grader.grade, Sample(output_text="a" * 40 + "b"), {"pattern": "^(a|a)+$"})
    assert seconds < QUICK.regex_timeout_seconds + 0.3
    assert [error["code"] for error in result.errors] == ["regex_timeout"]


def test_the_timeout_defaults_to_one_second():
    grader = build_grader(regex("^(a|a)+$"))
    result, seconds = timed(grader.grade, Sample(output_text="a" * 40 + "b"), {})
    assert 0.9 < seconds < 1.3
    assert [error["code"] for error in result.errors] == ["regex_timeout"]


def test_matching_releases_the_gil_for_other_threads():
    # `re` holds the GIL for the whole match: this thread would not wake for the timeout's length.
    grader = build_grader(regex("^(a|a)+$"), sandbox=QUICK)
    results = []
    grading = threading.Thread(
        target=lambda: results.append(grader.grade(Sample(output_text="a" * 40 + "b"), {}))
    )
    grading.start()
    worst, last = 0.0, time.perf_counter()
    while grading.is_alive():
        time.sleep(0.005)
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    assert [error["code"] for error in results[0].errors] == ["regex_timeout"]
    assert worst < 0.1, f"this thread waited {worst * 1000:.0f} ms for the GIL"


@pytest.mark.parametrize(
    "pattern", ["x{4294967294}", "a{10000000}", "(a{1000}){1000}", "((ab){100}){100}x", "[a-z]{10001}"]
)
def test_repeats_too_large_to_compile_are_refused_at_validation(pattern):
    # The regex package expands exact repeat counts when compiling: a{10000000} took 6 s.
    started = time.perf_counter()
    with pytest.raises(GraderSpecError, match="repeats too large"):
        validate_grader(regex(pattern))
    assert time.perf_counter() - started < 0.5


def test_ranges_and_moderate_repeats_are_fine():
    for pattern in ("a{1,100000}", "a{0,4294967294}", r"\d{4}-\d{2}-\d{2}", "(ab){1000}", "[a-z]{10000}"):
        validate_grader(regex(pattern))


def test_a_rendered_pattern_too_large_to_compile_is_a_regex_error():
    grader = build_grader(regex("^{{item.answer}}$"))
    result = grader.grade(Sample(output_text="x"), {"answer": "x{4294967294}"})
    assert [error["code"] for error in result.errors] == ["regex_error"]
    assert "repeats too large" in result.errors[0]["detail"]


@pytest.mark.parametrize(
    ("pattern", "flags", "text"),
    [
        (r"(?P<word>\w+) (?P=word)", [], "the the end"),
        (r"(\w+) \1", [], "no repeat"),
        (r"(?<=\$)\d+", [], "costs $42"),
        (r"(?<!\$)\b\d+", [], "$42"),
        (r"a++b", [], "aaab"),
        (r"(?>a+)ab", [], "aaab"),
        (r"(?i)straße", [], "STRASSE"),
        (r"(?i)straße", [], "STRAßE"),
        (r"\w+$", [], "naïve"),
        (r"^\d$", [], "٣"),
        (r"[[]", [], "["),
        (r"[a-z&&[^x]]", [], "&&"),  # set operations are V1 only: literal characters here, as in re
        (r"[a-z--x]", [], "-"),
        (r"(?x) a b  # comment", [], "ab"),
        (r"b$", [], "ab\n"),
        (r"b\Z", [], "ab\n"),
        (r"^b", ["MULTILINE"], "a\nb"),
        (r"a.b", ["DOTALL"], "a\nb"),
        (r"(a)?(?(1)b|c)", [], "c"),
        (r"\p{L}", [], "p{L}"),  # not a property in re: a literal p{L}, as in re
    ],
)
def test_patterns_mean_what_they_mean_in_pythons_re(pattern, flags, text):
    import re as python_re

    try:
        expected = python_re.search(pattern, text, sum(getattr(python_re, name) for name in flags))
    except python_re.error:
        with pytest.raises(GraderSpecError):
            validate_grader(regex(pattern, flags=flags))
        return
    result = grade(regex(pattern, flags=flags), Sample(output_text=text), {})
    assert result.errors == []
    assert result.reward == (1.0 if expected else 0.0)
