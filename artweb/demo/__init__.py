"""The demo run: one-word questions for the bundled SmolLM2-135M-Instruct on CPU.

Each row's item carries ``answer`` (shown as the reference) and ``accept`` (a regex alternation of
the answers that count, e.g. ``8|eight``). The reward is a ``multi`` grader,
``correct * (0.5 + 0.5 * exact) + said``:
- ``correct``: an accepted answer appears as a whole word (``\\b…\\b``, case-insensitive), so
  "alphabet" no longer counts as "A" and "1000" no longer as "100" (the old ``ilike`` contains did);
- ``exact``: the whole reply is that answer, give or take punctuation and an article ("Paris.").
- ``said``: -1 for a reply without a letter or digit (empty, "..."), else 0: saying nothing is the
  worst reply (an empty reply pays no length penalty, and on one machine a run's replies collapsed
  to empty strings before this term).
A wrong or gibberish reply earns 0 however short it is, so brevity cannot be hacked; a right answer
in a sentence earns 0.5 and the bare answer 1.0. The base model answers in sentences ("The capital
of France is Paris."), which is what the demo's ``STEPS`` teach it out of. Measured figures: README
("The demo") and benchmarks/demo_learning.py.
"""

from pathlib import Path

__all__ = ["REWARD_SPEC", "STEPS", "SYSTEM_PROMPT", "TASKS_PATH"]

TASKS_PATH = Path(__file__).with_name("format_tasks.jsonl")

SYSTEM_PROMPT = "Answer with one word only."

# The demo run's steps (`make up`). The base model seldom starts a reply with the answer (under 1%
# of its first-token probability on these questions); the length penalty shortens its sentences
# step by step until bare answers appear; some runs ended 20 or 30 steps still in sentences. With
# the demo's recipe (projects.defaults.RUN_CONFIG), 40 steps gained +0.250 to +0.458 held-out over
# seeds 0-4 at 1 and 2 torch threads on an AMD EPYC machine (README "The demo").
STEPS = 40

REWARD_SPEC = {
    "type": "multi",
    "name": "correct_and_exact",
    "graders": {
        "correct": {
            "type": "regex",
            "input": "{{sample.output_text}}",
            "pattern": r"\b(?:{{item.accept}})\b",
            "flags": ["IGNORECASE"],
        },
        "exact": {
            "type": "regex",
            "input": "{{sample.output_text}}",
            "pattern": r"\W*(?:(?:the|an?)\s+)?(?:{{item.accept}})\W*",
            "flags": ["IGNORECASE"],
            "mode": "fullmatch",
        },
        "said": {
            "type": "regex",
            "input": "{{sample.output_text}}",
            "pattern": r"\w",
            "score_on_match": 0.0,
            "score_on_miss": -1.0,
        },
    },
    "calculate_output": "correct * (0.5 + 0.5 * exact) + said",
}
