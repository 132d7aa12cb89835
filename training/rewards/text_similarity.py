"""`text_similarity`: how close the rendered input is to a reference, compatible with OpenAI's grader.

    {"type": "text_similarity", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
     "evaluation_metric": "rouge_l", "pass_threshold": 0.6}

Every metric is in [0, 1]; the reward is the score, or 1/0 against `pass_threshold` when given.
Written here (standard library only) to the usual definitions:
- `fuzzy_match`: 2·LCS/(len(a)+len(b)) over characters, the normalised Indel similarity that
  rapidfuzz's `fuzz.ratio` reports (÷100).
- `bleu`: sacrebleu's `sentence_bleu`: 13a tokenisation, n-grams up to 4, brevity penalty,
  "exp" smoothing and effective order (÷100).
- `gleu`: Google-BLEU (Wu et al. 2016, nltk's `sentence_gleu`): min(precision, recall) over all
  1..4-grams, 13a tokens.
- `meteor`: nltk's `meteor_score` formula (alpha 0.9, beta 3, gamma 0.5, lower-cased 13a tokens)
  with exact word matches only: no stemming and no WordNet synonyms (no offline WordNet here), so
  it scores paraphrases lower than nltk would.
- `rouge_1` … `rouge_5`, `rouge_l`: F1 as rouge_score computes it (lower-cased alphanumeric tokens,
  no stemmer), except that non-ASCII letters are kept rather than dropped.
`cosine` needs an embedding model, and none is available offline: refused at validation.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

from training.rewards.base import Field, Grader, GraderRuntime, Sample, Score
from training.rewards.templates import Template

METRICS = (
    "fuzzy_match",
    "bleu",
    "gleu",
    "meteor",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
    "cosine",
)
UNAVAILABLE = {"cosine": "not available: no embedding model offline"}
# Bounds the work per sample; every metric is at most quadratic in this only through bit-parallel
# LCS, which handles it in well under a second.
MAX_INPUT_CHARS = 20_000


class TextSimilarityGrader(Grader):
    type: ClassVar[str] = "text_similarity"
    fields: ClassVar[dict[str, Field]] = {
        "input": Field("string", required=True, template=True),
        "reference": Field("string", required=True, template=True),
        "evaluation_metric": Field("string", required=True, choices=METRICS),
        "pass_threshold": Field("number"),
    }

    @classmethod
    def check_spec(cls, spec: dict[str, Any], path: str) -> list[dict[str, str]]:
        metric = spec.get("evaluation_metric")
        if metric in UNAVAILABLE:
            return [{"path": f"{path}.evaluation_metric", "message": f"{metric!r} is {UNAVAILABLE[metric]}"}]
        return []

    def __init__(self, spec: dict[str, Any], runtime: GraderRuntime | None = None) -> None:
        super().__init__(spec, runtime)
        self.input = Template.parse(spec["input"])
        self.reference = Template.parse(spec["reference"])
        self.metric: Callable[[str, str], float] = METRIC_FUNCTIONS[spec["evaluation_metric"]]
        self.pass_threshold: float | None = spec.get("pass_threshold")

    def score(self, sample: Sample, item: dict[str, Any]) -> Score:
        text = self.input.render(sample, item)[:MAX_INPUT_CHARS]
        reference = self.reference.render(sample, item)[:MAX_INPUT_CHARS]
        value = self.metric(text, reference)
        reward = value if self.pass_threshold is None else float(value >= self.pass_threshold)
        return Score(reward, {"score": value})


# --- tokenisers -------------------------------------------------------------------------------

_13A_RULES = [
    (re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "),  # punctuation and symbols
    (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),  # period/comma unless preceded by a digit
    (re.compile(r"([\.,])([^0-9])"), r" \1 \2"),  # period/comma unless followed by a digit
    (re.compile(r"([0-9])(-)"), r"\1 \2 "),  # dash after a digit
]


def tokenize_13a(text: str) -> list[str]:
    """sacrebleu's default (mteval-v13a) tokeniser."""
    text = text.replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in text:
        text = text.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    text = f" {text} "
    for pattern, replacement in _13A_RULES:
        text = pattern.sub(replacement, text)
    return text.split()


def tokenize_rouge(text: str) -> list[str]:
    return re.sub(r"[\W_]+", " ", text.lower()).split()


def ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence, bit-parallel (Hyyrö 2004): one big-integer
    update per element of `b`, so 20k × 20k characters take milliseconds, not minutes."""
    if not a or not b:
        return 0
    masks: dict[Hashable, int] = {}
    for index, element in enumerate(a):
        masks[element] = masks.get(element, 0) | (1 << index)
    all_ones = (1 << len(a)) - 1
    row = all_ones
    for element in b:
        matches = row & masks.get(element, 0)
        row = ((row + matches) | (row - matches)) & all_ones
    return len(a) - row.bit_count()


# --- metrics ----------------------------------------------------------------------------------


def fuzzy_match(text: str, reference: str) -> float:
    if not text and not reference:
        return 1.0
    return 2 * lcs_length(text, reference) / (len(text) + len(reference))


def bleu(text: str, reference: str, max_order: int = 4) -> float:
    hypothesis, ref = tokenize_13a(text), tokenize_13a(reference)
    if not hypothesis:
        return 0.0
    precisions = []
    smooth = 1.0
    for n in range(1, max_order + 1):
        hyp_counts, ref_counts = ngrams(hypothesis, n), ngrams(ref, n)
        total = sum(hyp_counts.values())
        if total == 0:
            break  # effective order: a short sentence is not punished for lacking long n-grams
        correct = sum(min(count, ref_counts[gram]) for gram, count in hyp_counts.items())
        if correct == 0 and n == 1:
            return 0.0  # no word in common: 0 however it is smoothed, as sacrebleu has it
        if correct == 0:
            smooth *= 2
            precisions.append(1.0 / (smooth * total))
        else:
            precisions.append(correct / total)
    brevity = 1.0 if len(hypothesis) >= len(ref) else math.exp(1 - len(ref) / len(hypothesis))
    return brevity * math.exp(sum(math.log(p) for p in precisions) / len(precisions))


def gleu(text: str, reference: str, max_order: int = 4) -> float:
    hypothesis, ref = tokenize_13a(text), tokenize_13a(reference)
    matches = hyp_total = ref_total = 0
    for n in range(1, max_order + 1):
        hyp_counts, ref_counts = ngrams(hypothesis, n), ngrams(ref, n)
        hyp_total += sum(hyp_counts.values())
        ref_total += sum(ref_counts.values())
        matches += sum(min(count, ref_counts[gram]) for gram, count in hyp_counts.items())
    if hyp_total == 0 or ref_total == 0:
        return 0.0
    return min(matches / hyp_total, matches / ref_total)


def meteor(text: str, reference: str, alpha: float = 0.9, beta: float = 3.0, gamma: float = 0.5) -> float:
    hypothesis = [token.lower() for token in tokenize_13a(text)]
    ref = [token.lower() for token in tokenize_13a(reference)]
    # nltk's exact-match stage: from the end of the hypothesis, each word takes the last unused
    # equal word of the reference.
    unused = list(enumerate(ref))
    matches = []
    for hyp_index in range(len(hypothesis) - 1, -1, -1):
        for position in range(len(unused) - 1, -1, -1):
            if unused[position][1] == hypothesis[hyp_index]:
                matches.append((hyp_index, unused.pop(position)[0]))
                break
    if not matches:
        return 0.0
    matches.sort()
    chunks = 1 + sum(
        1
        for (hyp_a, ref_a), (hyp_b, ref_b) in zip(matches, matches[1:], strict=False)
        if not (hyp_b == hyp_a + 1 and ref_b == ref_a + 1)
    )
    precision, recall = len(matches) / len(hypothesis), len(matches) / len(ref)
    fmean = precision * recall / (alpha * precision + (1 - alpha) * recall)
    penalty = gamma * (chunks / len(matches)) ** beta
    return fmean * (1 - penalty)


def _f1(overlap: int, hyp_total: int, ref_total: int) -> float:
    if overlap == 0 or hyp_total == 0 or ref_total == 0:
        return 0.0
    precision, recall = overlap / hyp_total, overlap / ref_total
    return 2 * precision * recall / (precision + recall)


def rouge_n(n: int) -> Callable[[str, str], float]:
    def rouge(text: str, reference: str) -> float:
        hyp_counts, ref_counts = ngrams(tokenize_rouge(text), n), ngrams(tokenize_rouge(reference), n)
        overlap = sum(min(count, ref_counts[gram]) for gram, count in hyp_counts.items())
        return _f1(overlap, sum(hyp_counts.values()), sum(ref_counts.values()))

    return rouge


def rouge_l(text: str, reference: str) -> float:
    hypothesis, ref = tokenize_rouge(text), tokenize_rouge(reference)
    return _f1(lcs_length(hypothesis, ref), len(hypothesis), len(ref))


METRIC_FUNCTIONS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": fuzzy_match,
    "bleu": bleu,
    "gleu": gleu,
    "meteor": meteor,
    **{f"rouge_{n}": rouge_n(n) for n in range(1, 6)},
    "rouge_l": rouge_l,
}
