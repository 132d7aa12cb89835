"""Expected values are worked by hand below and were cross-checked once against rapidfuzz
(fuzz.ratio), sacrebleu (sentence BLEU), nltk (sentence_gleu; meteor_score with stemming and
WordNet switched off) and rouge_score: all agree to 1e-9."""

import math

import pytest

from training.rewards import GraderSpecError, Sample, build_grader, validate_grader
from training.rewards.text_similarity import METRIC_FUNCTIONS, lcs_length, tokenize_13a

REFERENCE = "the cat sat on the mat"


def similarity(metric, **extra):
    return {
        "type": "text_similarity",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference}}",
        "evaluation_metric": metric,
        **extra,
    }


def score(metric, output, reference=REFERENCE):
    result = build_grader(similarity(metric)).grade(Sample(output_text=output), {"reference": reference})
    assert result.errors == []
    return result.reward


@pytest.mark.parametrize("metric", [m for m in METRIC_FUNCTIONS if m not in ("meteor",)])
def test_identical_texts_score_one(metric):
    assert score(metric, REFERENCE) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        # 3 of 6 reference words, all 3 output words match: P = 1, R = 1/2, F1 = 2/3.
        ("rouge_1", 2 / 3),
        # bigrams: 2 of 2 output, 2 of 5 reference: P = 1, R = 2/5, F1 = 4/7.
        ("rouge_2", 4 / 7),
        # trigrams: 1 of 1, 1 of 4: F1 = 2/5.
        ("rouge_3", 2 / 5),
        ("rouge_4", 0.0),
        # LCS 3: same as rouge_1 here.
        ("rouge_l", 2 / 3),
        # every n-gram precision is 1 (effective order 3); brevity penalty exp(1 - 6/3).
        ("bleu", math.exp(-1)),
        # 6 output n-grams (3+2+1) all match, the reference has 18 (6+5+4+3): min(1, 6/18).
        ("gleu", 1 / 3),
        # nltk aligns from the end: output "the" takes the reference's second "the", so 3 matches
        # in 2 chunks. fmean = PR/(0.9P + 0.1R) = 0.5/0.95; penalty 0.5 * (2/3)^3.
        ("meteor", (0.5 / 0.95) * (1 - 0.5 * (2 / 3) ** 3)),
        # characters: LCS("the cat sat", "the cat sat on the mat") = 11; 2*11/(11+22).
        ("fuzzy_match", 22 / 33),
    ],
)
def test_hand_checked_scores_for_a_truncated_answer(metric, expected):
    assert score(metric, "the cat sat") == pytest.approx(expected, abs=1e-9)


def test_more_hand_checked_scores():
    # LCS("kitten", "sitting") = "ittn": 2*4/13 (rapidfuzz: 61.54).
    assert score("fuzzy_match", "kitten", "sitting") == pytest.approx(8 / 13)
    # One exact chunk of 6 words: penalty 0.5 * (1/6)^3.
    assert score("meteor", REFERENCE) == pytest.approx(1 - 0.5 / 216)
    # "the cat": P1 = P2 = 1, brevity exp(1 - 6/2); GLEU 3/18.
    assert score("bleu", "the cat") == pytest.approx(math.exp(-2))
    assert score("gleu", "the cat") == pytest.approx(1 / 6)
    # No word in common.
    for metric in ("bleu", "gleu", "meteor", "rouge_1", "rouge_l"):
        assert score(metric, "dogs bark loudly") == 0.0
    # rouge tokens are lower-cased words: punctuation and case do not matter.
    assert score("rouge_1", "The CAT, sat!") == pytest.approx(2 / 3)


def test_pass_threshold_gives_one_or_zero_and_keeps_the_score():
    grader = build_grader(similarity("rouge_1", pass_threshold=0.6))
    passing = grader.grade(Sample(output_text="the cat sat"), {"reference": REFERENCE})
    assert (passing.reward, passing.scores["score"]) == (1.0, pytest.approx(2 / 3))
    failing = build_grader(similarity("rouge_1", pass_threshold=0.7)).grade(
        Sample(output_text="the cat sat"), {"reference": REFERENCE}
    )
    assert failing.reward == 0.0


def test_cosine_is_refused_as_not_available():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader(similarity("cosine"))
    assert caught.value.problems == [
        {
            "path": "grader.evaluation_metric",
            "message": "'cosine' is not available: no embedding model offline",
        }
    ]


def test_unknown_metric_and_missing_fields_are_reported_together():
    with pytest.raises(GraderSpecError) as caught:
        validate_grader({"type": "text_similarity", "evaluation_metric": "rouge_9", "pass_threshold": "high"})
    assert {p["path"] for p in caught.value.problems} == {
        "grader.input",
        "grader.reference",
        "grader.evaluation_metric",
        "grader.pass_threshold",
    }


def test_missing_reference_is_a_template_error():
    result = build_grader(similarity("bleu")).grade(Sample(output_text="x"), {})
    assert [e["code"] for e in result.errors] == ["template_error"]


def test_lcs_matches_dynamic_programming():
    def slow(a, b):
        row = [0] * (len(b) + 1)
        for x in a:
            previous = 0
            for j, y in enumerate(b, start=1):
                previous, row[j] = row[j], previous + 1 if x == y else max(row[j], row[j - 1])
        return row[-1]

    pairs = [
        ("", "abc"),
        ("abc", "abc"),
        ("abcbdab", "bdcaba"),
        ("aaaa", "aa"),
        ("xyz", "abc"),
        ("banana", "atana"),
    ]
    for a, b in pairs:
        assert lcs_length(a, b) == slow(a, b), (a, b)
    assert lcs_length(["the", "cat"], ["a", "cat", "the"]) == 1


def test_long_inputs_are_fast():
    text = "lorem ipsum dolor sit amet " * 700  # ~19k characters
    grader = build_grader(similarity("fuzzy_match"))
    result = grader.grade(Sample(output_text=text), {"reference": text[::-1]})
    assert result.errors == [] and result.execution_time < 2.0


def test_13a_tokenisation_splits_punctuation_but_not_numbers():
    assert tokenize_13a("Hello, world! It costs 2,100.50 dollars.") == [
        "Hello",
        ",",
        "world",
        "!",
        "It",
        "costs",
        "2,100.50",
        "dollars",
        ".",
    ]
