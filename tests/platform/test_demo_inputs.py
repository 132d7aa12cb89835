"""The demo's inputs (artweb.demo): enough held-out rows, and a reward that matches whole words
and cannot be gamed by brevity (the old `ilike` contains scored "…of the alphabet is 'Gu'" as "A")."""

from __future__ import annotations

import json
import re

from artweb.demo import REWARD_SPEC, TASKS_PATH
from projects.defaults import RUN_CONFIG
from training.rewards import grade_trajectories
from training.rollouts.trajectory import Trajectory


def reply(text: str) -> Trajectory:
    return Trajectory(
        messages=[{"role": "assistant", "content": text}],
        prompt_token_ids=[1],
        completion_token_ids=[2],
        logprobs=[-1.0],
        finish_reason="stop",
    )


def test_task_set_has_twenty_held_out_rows_with_valid_accept_patterns():
    rows = [json.loads(line) for line in TASKS_PATH.read_text().splitlines() if line.strip()]
    validation = [row for row in rows if row["split"] == "validation"]
    assert len(validation) >= 20 and RUN_CONFIG["eval_max_rows"] >= len(validation)
    assert RUN_CONFIG["eval_temperature"] == 0, "greedy evaluation"
    for row in rows:
        assert re.fullmatch(f"(?:{row['item']['accept']})", row["item"]["answer"], re.IGNORECASE), row


def test_reward_wants_the_whole_word_and_pays_brevity_only_with_it():
    rows = [
        {"index": 0, "data": {"item": {"answer": "8", "accept": "8|eight"}}},
        {"index": 1, "data": {"item": {"answer": "Paris", "accept": "Paris"}}},
    ]
    groups = [
        [reply("Eight."), reply("A spider has 8 legs."), reply("around 1000"), reply("x")],
        [reply("Paris"), reply("The capital is Paris."), reply("Parisian food"), reply("Lyon.")],
    ]
    grade_trajectories(REWARD_SPEC, groups, rows, max_error_fraction=0.0)
    assert [[t.reward for t in group] for group in groups] == [[1.0, 0.5, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]]


def test_saying_nothing_is_the_worst_reply():
    # On an AMD EPYC machine at 1 torch thread, seed 0's replies collapsed to empty strings: the
    # length penalty charges a wrong sentence past 4 tokens and nothing charged an empty reply, so in
    # a group where every answer was wrong, saying nothing won. An empty (or punctuation-only) reply
    # now scores -1: as low as the longest wrong reply after the penalty (0 - 12/12 at 16 tokens).
    rows = [{"index": 0, "data": {"item": {"answer": "Paris", "accept": "Paris"}}}]
    groups = [
        [reply(""), reply(" ..."), reply("Lyon."), reply("The capital of France is Lyon."), reply("Paris")]
    ]
    grade_trajectories(REWARD_SPEC, groups, rows, max_error_fraction=0.0)
    assert [t.reward for t in groups[0]] == [-1.0, -1.0, 0.0, 0.0, 1.0]


def test_demo_evaluations_pass_a_correct_answer_and_fail_a_wrong_one():
    # The base model answers in sentences ("The capital is Paris.", 0.5): at the default threshold
    # 1.0 the step-0 evaluation would read pass rate 0 however many it answers right, and the pass
    # rate would count only the one-word answers the run taught, not the right ones.
    rows = [{"index": 0, "data": {"item": {"answer": "Paris", "accept": "Paris"}}}]
    groups = [[reply("Paris"), reply("The capital is Paris."), reply("Lyon.")]]
    grade_trajectories(REWARD_SPEC, groups, rows, max_error_fraction=0.0)
    threshold = RUN_CONFIG["eval_pass_threshold"]
    assert [t.reward >= threshold for t in groups[0]] == [True, True, False]
