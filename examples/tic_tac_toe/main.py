"""Tic-tac-toe: the client owns the board and the opponent; the model proposes its moves.

    .venv-art/bin/python examples/tic_tac_toe/main.py --steps 10 --base-url http://127.0.0.1:8000/v1 --api-key aw_...

The model plays X and moves first against a random opponent (seeded per scenario); it answers each
board with the number of an empty cell. Reward from the game: win 1, draw 0.5, loss 0; an answer
that is not an empty cell ends the game at -0.5 (a taken cell) or -1 (no cell number at all).
"""

from __future__ import annotations

import asyncio
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  (first: it sets ART's environment)
from common import art  # noqa: E402

LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
SYSTEM = (
    "You are playing tic-tac-toe as X. The board shows X, O and the numbers of the empty cells. "
    "Reply with only the number of the empty cell you take, for example: 5"
)
MAX_TOKENS = 4


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    cells = [mark if mark != " " else str(index + 1) for index, mark in enumerate(board)]
    return "\n".join("|".join(cells[row * 3 : row * 3 + 3]) for row in range(3))


def parse_move(text: str) -> int | None:
    """The cell named by the first digit of the reply."""
    found = re.search(r"[1-9]", text)
    return None if found is None else int(found.group()) - 1


async def rollout(model: art.TrainableModel, seed: int, temperature: float) -> art.Trajectory:
    opponent = random.Random(seed)
    board = [" "] * 9
    if seed % 2:  # half the scenarios open with O in a random cell, so boards vary from the first turn
        board[opponent.randrange(9)] = "O"
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": render(board)}]
    trajectory = art.Trajectory(messages_and_choices=list(messages), reward=0.0, metadata={"seed": seed})
    while True:
        choice = await common.sample(model, messages, max_tokens=MAX_TOKENS, temperature=temperature)
        text = choice.message.content or ""
        trajectory.messages_and_choices.append(choice)
        messages.append({"role": "assistant", "content": text})
        move = parse_move(text)
        if move is None or board[move] != " ":
            trajectory.reward = -1.0 if move is None else -0.5
            trajectory.metrics["invalid_move"] = 1.0
            return trajectory
        board[move] = "X"
        if winner(board) == "X":
            trajectory.reward = 1.0
            return trajectory
        empty = [index for index, mark in enumerate(board) if mark == " "]
        if not empty:
            trajectory.reward = 0.5
            return trajectory
        board[opponent.choice(empty)] = "O"
        if winner(board) == "O":
            trajectory.reward = 0.0
            return trajectory
        if " " not in board:
            trajectory.reward = 0.5
            return trajectory
        messages.append({"role": "user", "content": render(board)})
        trajectory.messages_and_choices.append(messages[-1])


def main() -> None:
    args = common.parser(__doc__.splitlines()[0], model="tic-tac-toe").parse_args()
    held_out = [10_000 + row for row in range(args.eval_rows)]  # seeds never used in training

    def train_scenarios(step: int) -> list[int]:
        return [args.seed + step * args.groups + group for group in range(args.groups)]

    asyncio.run(common.train(args, rollout=rollout, train_scenarios=train_scenarios, held_out=held_out))


if __name__ == "__main__":
    main()
