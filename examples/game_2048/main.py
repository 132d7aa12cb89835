"""2048: the client owns the 4x4 board (and its random tiles); the model proposes each move.

    .venv-art/bin/python examples/game_2048/main.py --steps 10 --base-url http://127.0.0.1:8000/v1 --api-key aw_...

A game is a few moves (``--moves``, short so a CPU model can play it); the model answers each board
with the number of a move (1 left, 2 right, 3 up, 4 down: the bundled 135M model names a digit far
more often than a direction word; a direction word counts too). Reward: log2 of the largest tile over 11 (2048 scores 1.0), or -1 for
an answer that names no direction and -0.5 for a move that changes nothing (the game ends there).
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  (first: it sets ART's environment)
from common import art  # noqa: E402

SYSTEM = "You are playing 2048. A move slides every tile that way; equal tiles that meet merge."
QUESTION = "Your move? 1 = left, 2 = right, 3 = up, 4 = down. Reply with the number only."
DIRECTIONS = {"1": "left", "2": "right", "3": "up", "4": "down"}
MAX_TOKENS = 4
Board = list[list[int]]


def add_tile(board: Board, rng: random.Random) -> None:
    empty = [(r, c) for r in range(4) for c in range(4) if board[r][c] == 0]
    if empty:
        r, c = rng.choice(empty)
        board[r][c] = 4 if rng.random() < 0.1 else 2


def slide_left(row: list[int]) -> list[int]:
    tiles = [value for value in row if value]
    merged: list[int] = []
    while tiles:
        if len(tiles) > 1 and tiles[0] == tiles[1]:
            merged.append(tiles[0] * 2)
            tiles = tiles[2:]
        else:
            merged.append(tiles.pop(0))
    return merged + [0] * (4 - len(merged))


def move(board: Board, direction: str) -> Board:
    """The board after a move; rows are turned so that every move is a slide to the left."""
    if direction in ("left", "right"):
        rows = [row[::-1] if direction == "right" else row for row in board]
        slid = [slide_left(row) for row in rows]
        return [row[::-1] if direction == "right" else row for row in slid]
    columns = [[board[r][c] for r in range(4)] for c in range(4)]
    columns = [column[::-1] if direction == "down" else column for column in columns]
    slid = [slide_left(column) for column in columns]
    slid = [column[::-1] if direction == "down" else column for column in slid]
    return [[slid[c][r] for c in range(4)] for r in range(4)]


def render(board: Board) -> str:
    rows = "\n".join(" ".join(f"{value or '.':>4}" for value in row) for row in board)
    return f"{rows}\n\n{QUESTION}"


def parse_direction(text: str) -> str | None:
    """The first move number or direction word in the reply."""
    found = re.search(r"[1-4]|\b(?:left|right|up|down)\b", text.lower())
    return None if found is None else DIRECTIONS.get(found.group(), found.group())


def make_rollout(moves: int) -> common.Rollout:
    async def rollout(model: art.TrainableModel, seed: int, temperature: float) -> art.Trajectory:
        rng = random.Random(seed)
        board: Board = [[0] * 4 for _ in range(4)]
        add_tile(board, rng)
        add_tile(board, rng)
        messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": render(board)}]
        trajectory = art.Trajectory(messages_and_choices=list(messages), reward=0.0, metadata={"seed": seed})
        for turn in range(moves):
            choice = await common.sample(model, messages, max_tokens=MAX_TOKENS, temperature=temperature)
            text = choice.message.content or ""
            trajectory.messages_and_choices.append(choice)
            messages.append({"role": "assistant", "content": text})
            direction = parse_direction(text)
            after = move(board, direction) if direction else board
            if direction is None or after == board:
                trajectory.reward = -1.0 if direction is None else -0.5
                trajectory.metrics["invalid_move"] = 1.0
                return trajectory
            board = after
            add_tile(board, rng)
            if turn + 1 < moves:
                messages.append({"role": "user", "content": render(board)})
                trajectory.messages_and_choices.append(messages[-1])
        trajectory.reward = math.log2(max(max(row) for row in board)) / 11
        trajectory.metrics["max_tile"] = float(max(max(row) for row in board))
        return trajectory

    return rollout


def main() -> None:
    flags = common.parser(__doc__.splitlines()[0], model="game-2048")
    flags.add_argument("--moves", type=int, default=4, help="moves per game")
    args = flags.parse_args()
    held_out = [10_000 + row for row in range(args.eval_rows)]  # seeds never used in training

    def train_scenarios(step: int) -> list[int]:
        return [args.seed + step * args.groups + group for group in range(args.groups)]

    rollout = make_rollout(args.moves)
    asyncio.run(common.train(args, rollout=rollout, train_scenarios=train_scenarios, held_out=held_out))


if __name__ == "__main__":
    main()
