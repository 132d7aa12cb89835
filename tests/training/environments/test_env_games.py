"""tic_tac_toe and 2048: the rules, the environment's replies between model turns (user messages,
mask 0), invalid moves, the outcome and its reward, on scripted and tiny-model players."""

import math
import re

import pytest

from training.base_models import load_base_model
from training.engines.base import SamplingParams
from training.engines.transformers_engine import TransformersEngine
from training.environments import build_environment
from training.environments.game_2048 import parse_direction, slide
from training.environments.tic_tac_toe import board_text, parse_move, winner
from training.rewards import Sample, build_grader, grade, grade_trajectories
from training.rollouts.agent import rollout_groups

SAMPLING = SamplingParams(max_new_tokens=16, seed=3)


def first_free_cell(text: str) -> str:
    """A player that takes the first free cell listed in the last board it was shown."""
    free = re.findall(r"Free cells: (.*)", text)[-1].split(", ")
    return f"I take <move>{free[0]}</move>"


def test_tic_tac_toe_rules():
    board = list("XXX" + "OO " + "   ")
    assert winner(board) == "X" and winner(list("XO " + "XO " + " O ")) == "O" and winner([" "] * 9) is None
    assert parse_move("<move>c3</move>", board) == (8, None)
    assert parse_move("<move>A1</move>", board) == (None, "A1 is taken")
    assert parse_move("<move>D4</move>", board) == (None, "'D4' is not a cell (A1 to C3)")
    assert parse_move("B3", board) == (None, "no <move>CELL</move> in your reply")
    assert parse_move("<move>A1</move> no, <move>C2</move>", board) == (5, None)  # the last tag counts
    assert board_text(board) == "  A B C\n1 X X X\n2 O O .\n3 . . ."


def test_a_whole_tic_tac_toe_game_is_played_and_scored(policy_engine, token_exact):
    env = build_environment("tic_tac_toe")
    engine = policy_engine(first_free_cell)
    ((trajectory,),) = rollout_groups(
        engine, [{"prompt": "Let's play.", "item": {"seed": 7}}], env, SAMPLING, 1
    )

    outcome = trajectory.outcome
    assert outcome["result"] in ("win", "draw", "loss")
    assert outcome["reward"] == {"win": 1.0, "draw": 0.5, "loss": 0.0}[outcome["result"]]
    assert outcome["invalid_moves"] == 0 and outcome["moves"] == trajectory.metrics["turns"]
    # The environment's turns are user messages showing the opponent's move and the board.
    roles = [m["role"] for m in trajectory.messages]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
    assert roles[2:] == ["assistant", "user"] * (trajectory.metrics["turns"] - 1) + ["assistant"]
    assert trajectory.messages[1]["content"].startswith("Let's play.\n\nYou play X.\n  A B C\n1 . . .")
    assert all(re.match(r"I played [A-C][1-3]\.\n  A B C", m["content"]) for m in trajectory.messages[3::2])
    assert trajectory.metrics["turns"] >= 3  # X needs three moves to win at the earliest
    token_exact(engine, trajectory)
    # The final board agrees with the result: a win or loss has three in a row.
    marks = [c for line in outcome["board"].splitlines()[1:] for c in line.split()[1:]]
    assert (outcome["result"] == "win") == (winner([" " if c == "." else c for c in marks]) == "X")

    # The same seed replays the same game; the environment's grader reads the outcome.
    ((again,),) = rollout_groups(
        policy_engine(first_free_cell), [{"prompt": "Let's play.", "item": {"seed": 7}}], env, SAMPLING, 1
    )
    assert again.messages == trajectory.messages
    row = {"index": 0, "data": {"prompt": "Let's play."}}
    grade_trajectories({"type": "environment"}, [[trajectory]], [row], max_error_fraction=0.0)
    assert trajectory.reward == outcome["reward"]


def test_an_invalid_tic_tac_toe_move_forfeits_or_is_retried_with_a_penalty(policy_engine):
    row = {"prompt": "Play.", "item": {"seed": 1}}
    env = build_environment("tic_tac_toe")
    ((forfeit,),) = rollout_groups(policy_engine(lambda text: "I pick the middle."), [row], env, SAMPLING, 1)
    assert forfeit.metrics["turns"] == 1 and forfeit.metrics["invalid_moves"] == 1
    assert forfeit.outcome["result"] == "forfeit"
    assert forfeit.outcome["reward"] == pytest.approx(-0.1)

    lenient = build_environment(
        "tic_tac_toe",
        config={"max_invalid_moves": 2, "invalid_move_penalty": 0.25, "valid_move_reward": 0.05},
    )
    replies = iter(["<move>B2</move>", "<move>B2</move>"])
    ((retried,),) = rollout_groups(
        policy_engine(lambda text: next(replies, None) or first_free_cell(text)), [row], lenient, SAMPLING, 1
    )
    assert retried.messages[5]["content"].startswith("Invalid move: B2 is taken. Try again.\n  A B C")
    assert retried.outcome["invalid_moves"] == 1 and retried.metrics["invalid_moves"] == 1
    expected = {"win": 1.0, "draw": 0.5, "loss": 0.0}[retried.outcome["result"]]
    assert retried.outcome["reward"] == pytest.approx(expected + 0.05 * retried.outcome["moves"] - 0.25)


def test_playing_o_the_opponent_opens(policy_engine):
    env = build_environment("tic_tac_toe", config={"model_mark": "O"})
    ((trajectory,),) = rollout_groups(policy_engine(first_free_cell), [{"prompt": "Go."}], env, SAMPLING, 1)
    assert re.search(r"I played [A-C][1-3]\. You play O\.", trajectory.messages[1]["content"])
    assert trajectory.messages[1]["content"].count("X") == 1


def test_2048_slides_and_merges_like_the_game():
    board = [2, 2, 4, 0, 0, 4, 4, 4, 2, 0, 2, 2, 8, 8, 8, 8]
    left, gained = slide(board, "left")
    assert left == [4, 4, 0, 0, 8, 4, 0, 0, 4, 2, 0, 0, 16, 16, 0, 0]
    assert gained == 4 + 8 + 4 + 16 + 16
    assert slide(board, "right")[0] == [0, 0, 4, 4, 0, 0, 4, 8, 0, 0, 2, 4, 0, 0, 16, 16]
    assert slide(board, "up")[0][:4] == [4, 2, 8, 4] and slide(board, "down")[0][12:] == [8, 8, 8, 8]
    assert parse_direction("I go <move>Left</move>") == "left" and parse_direction("up.") == "up"
    assert parse_direction("sideways") is None


def test_a_2048_game_ends_at_max_turns_with_the_highest_tile_rewarded(policy_engine, token_exact):
    env = build_environment("2048", max_turns=6, config={"target": 64})
    moves = iter(["<move>left</move>", "<move>up</move>", "<move>right</move>", "<move>down</move>"] * 2)
    engine = policy_engine(lambda text: next(moves))
    ((trajectory,),) = rollout_groups(
        engine, [{"prompt": "Play 2048.", "item": {"seed": 4}}], env, SAMPLING, 1
    )
    outcome = trajectory.outcome
    valid = outcome["moves"]
    assert trajectory.metrics["turns"] == valid + outcome["invalid_moves"] <= 6
    assert outcome["max_tile"] in (4, 8, 16)
    assert outcome["reward"] == pytest.approx(
        {4: 2 / 6, 8: 3 / 6, 16: 4 / 6}[outcome["max_tile"]] - 0.05 * outcome["invalid_moves"]
    )
    assert trajectory.finish_reason == "max_turns" or outcome["result"] != "unfinished"
    assert all(m["role"] == "user" and m["content"].endswith("Your move?") for m in trajectory.messages[3::2])
    token_exact(engine, trajectory)


def test_2048_invalid_moves_end_the_game_after_the_allowed_number(policy_engine):
    env = build_environment("2048", config={"max_invalid_moves": 1})
    ((trajectory,),) = rollout_groups(
        policy_engine(lambda text: "Hmm."), [{"prompt": "Play."}], env, SAMPLING, 1
    )
    assert trajectory.metrics["turns"] == 2 and trajectory.outcome["result"] == "invalid"
    assert trajectory.messages[3]["content"].startswith("Invalid move: no <move>up|down|left|right</move>")
    max_tile = trajectory.outcome["max_tile"]  # the two starting tiles: 2s, or a 4 one time in ten
    assert max_tile in (2, 4)
    assert trajectory.outcome["reward"] == pytest.approx(math.log2(max_tile) / 11 - 0.1)  # log2(2048) = 11


def test_the_tiny_model_plays_games_end_to_end(tiny_model_dir, tmp_path):
    model, tokenizer = load_base_model(str(tiny_model_dir), tmp_path)
    engine = TransformersEngine(model.eval(), tokenizer)
    rows = [{"prompt": "Play.", "item": {"seed": 1}}, {"prompt": "Play again."}]
    for kind, config in (("tic_tac_toe", {"max_invalid_moves": 1}), ("2048", {"max_invalid_moves": 1})):
        env = build_environment(kind, config=config, max_turns=6)
        groups = rollout_groups(engine, rows, env, SamplingParams(max_new_tokens=12, seed=0), group_size=2)
        for group in groups:
            for trajectory in group:
                turns = trajectory.metrics["turns"]
                assert 1 <= turns <= 6
                assert len(trajectory.completion_mask) == len(trajectory.completion_token_ids)
                # A random model writes no valid move: it is told so, then the game ends.
                assert trajectory.outcome["invalid_moves"] >= 1
                assert trajectory.completion_mask.count(0) > 0 or turns == 1
                assert "reward" in trajectory.outcome


def test_the_environment_grader_maps_outcomes_to_rewards():
    sample = Sample(output_text="<move>A1</move>", outcome={"result": "draw", "reward": 0.5})
    assert grade({"type": "environment"}, sample, {}).reward == 0.5
    by_result = {"type": "environment", "field": "result", "values": {"win": 1, "draw": 0.25}}
    assert grade(by_result, sample, {}).reward == 0.25
    missing = grade({"type": "environment", "field": "max_tile", "error_reward": -1}, sample, {})
    assert missing.reward == -1.0
    assert (
        missing.errors[0]["code"] == "sample_parse_error"
        and "has no 'max_tile'" in missing.errors[0]["detail"]
    )
    not_number = grade({"type": "environment", "field": "result"}, sample, {})
    assert "not a number" in not_number.errors[0]["detail"]
    with pytest.raises(ValueError, match=r"grader.values.win: must be a finite number"):
        build_grader({"type": "environment", "values": {"win": "yes"}})
    # Templates and python graders see the outcome too.
    check = {
        "type": "string_check",
        "input": "{{sample.outcome.result}}",
        "reference": "draw",
        "operation": "eq",
    }
    assert grade(check, sample, {}).reward == 1.0
    assert Sample(output_text="", outcome={"reward": 1}).to_grader_dict()["outcome"] == {"reward": 1}
