"""`2048`: the model slides the tiles of a 4x4 board; the environment adds a tile after each move.

    {"kind": "2048", "max_turns": 40, "config": {"target": 2048, "max_invalid_moves": 3}}

Each model turn names a direction as `<move>left</move>` (up, down, left, right; the last tag counts,
or a reply that is just the word). A move that is not a direction, or that moves nothing, is
invalid: it costs `invalid_move_penalty`, and after more than `max_invalid_moves` the game ends.
The game ends at `target` (a win), when no move is left (game over), or at max_turns. Outcome:
`{"result": win|game_over|invalid|unfinished, "max_tile", "score", "moves", "invalid_moves",
"reward", "board"}` with reward `min(1, log2(max_tile) / log2(target))` minus the penalties. New
tiles are seeded per trajectory (`item.seed` overrides the seed).
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from training.environments.base import (
    ConfigError,
    Environment,
    EpisodeState,
    Reply,
    _object,
    _turns,
    game_start,
    integer,
    known_keys,
    number,
    show_board,
)
from training.rollouts.tools import ToolCall

DIRECTIONS = ("up", "down", "left", "right")
MOVE = re.compile(r"<move>\s*(\w+)\s*</move>", re.IGNORECASE)
DEFAULT_SYSTEM_PROMPT = (
    "You are playing 2048 on a 4x4 board. Each turn slide all tiles up, down, left or right; equal "
    "tiles that collide merge. Reach the highest tile you can. Answer with your move as "
    "<move>DIRECTION</move>, for example <move>left</move>."
)
CONFIG_HELP = {
    "target": "the winning tile, a power of two (default 2048); the reward is log2(max_tile)/log2(target)",
    "max_invalid_moves": "invalid moves allowed before the game ends (default 3)",
    "invalid_move_penalty": "subtracted from the reward per invalid move (default 0.05)",
}


class Game2048Environment(Environment):
    kind: ClassVar[str] = "2048"
    description: ClassVar[str] = "2048 on a 4x4 board; the model names its move as <move>left</move>."
    answer: ClassVar[str] = "each turn's <move>DIRECTION</move>; the highest tile and reward are in outcome"
    default_max_turns: ClassVar[int] = 40
    config_help: ClassVar[dict[str, str]] = CONFIG_HELP

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self.target: int = self.config.get("target", 2048)
        self.max_invalid_moves: int = self.config.get("max_invalid_moves", 3)
        self.invalid_move_penalty: float = self.config.get("invalid_move_penalty", 0.05)

    @classmethod
    def validate(cls, config: Any, tools: Any, max_turns: int | None) -> dict[str, Any]:
        config = _object(config, "config")
        known_keys(config, CONFIG_HELP)
        target = integer(config, "target", 2048, minimum=8, maximum=2**17)
        if target & (target - 1):
            raise ConfigError("config.target", "must be a power of two, e.g. 2048")
        integer(config, "max_invalid_moves", 3, minimum=0, maximum=100)
        number(config, "invalid_move_penalty", 0.05, minimum=0)
        if tools not in (None, []):
            raise ConfigError("tools", "a 2048 environment takes no tools")
        return {
            "config": config,
            "tools": [],
            "max_turns": _turns(max_turns, cls.default_max_turns, maximum=1000),
        }

    def start(self, row: dict[str, Any], *, seed: int | None = None) -> EpisodeState:
        system_prompt = self.system_prompt or DEFAULT_SYSTEM_PROMPT
        state = game_start(row, seed=seed, system_prompt=system_prompt)
        state.data.update(board=[0] * 16, score=0, moves=0, invalid_moves=0, result=None)
        state.metrics["invalid_moves"] = 0
        add_tile(state.data["board"], state.rng)
        add_tile(state.data["board"], state.rng)
        show_board(state, f"{board_text(state.data['board'])}\nYour move?", system_prompt=system_prompt)
        return state

    def reply_batch(
        self, states: list[EpisodeState], texts: list[str], calls: list[list[ToolCall]]
    ) -> list[Reply]:
        return [self.reply(state, text) for state, text in zip(states, texts, strict=True)]

    def reply(self, state: EpisodeState, text: str) -> Reply:
        board = state.data["board"]
        direction = parse_direction(text)
        moved, gained = slide(board, direction) if direction else (None, 0)
        if moved is None or moved == board:
            state.data["invalid_moves"] += 1
            state.metrics["invalid_moves"] += 1
            if state.data["invalid_moves"] > self.max_invalid_moves:
                state.data["result"] = "invalid"
                return Reply([], done=True)
            why = (
                f"{direction} moves no tile"
                if direction
                else "no <move>up|down|left|right</move> in your reply"
            )
            return Reply(
                [{"role": "user", "content": f"Invalid move: {why}.\n{board_text(board)}\nYour move?"}]
            )
        board[:] = moved
        state.data["score"] += gained
        state.data["moves"] += 1
        if max(board) >= self.target:
            state.data["result"] = "win"
            return Reply([], done=True)
        add_tile(board, state.rng)
        if not any(slide(board, d)[0] != board for d in DIRECTIONS):
            state.data["result"] = "game_over"
            return Reply([], done=True)
        return Reply([{"role": "user", "content": f"{board_text(board)}\nYour move?"}])

    def outcome(self, state: EpisodeState) -> dict[str, Any]:
        board = state.data["board"]
        max_tile = max(board)
        reward = min(1.0, math.log2(max_tile) / math.log2(self.target)) if max_tile else 0.0
        return {
            "result": state.data["result"] or "unfinished",
            "max_tile": max_tile,
            "score": state.data["score"],
            "moves": state.data["moves"],
            "invalid_moves": state.data["invalid_moves"],
            "reward": reward - self.invalid_move_penalty * state.data["invalid_moves"],
            "board": board_text(board),
        }


def parse_direction(text: str) -> str | None:
    tags = MOVE.findall(text)
    word = (tags[-1] if tags else text.strip().strip(".!").strip()).lower()
    return word if word in DIRECTIONS else None


def add_tile(board: list[int], rng: Any) -> None:
    empty = [index for index, value in enumerate(board) if value == 0]
    if empty:
        board[rng.choice(empty)] = 4 if rng.random() < 0.1 else 2


def slide(board: list[int], direction: str) -> tuple[list[int], int]:
    """The board after sliding in `direction`, and the points the merges scored."""
    lines = _lines(direction)
    result = list(board)
    gained = 0
    for line in lines:
        values = [board[index] for index in line if board[index]]
        merged: list[int] = []
        while values:
            if len(values) > 1 and values[0] == values[1]:
                merged.append(values[0] * 2)
                gained += values[0] * 2
                values = values[2:]
            else:
                merged.append(values.pop(0))
        merged += [0] * (4 - len(merged))
        for index, value in zip(line, merged, strict=True):
            result[index] = value
    return result, gained


def _lines(direction: str) -> list[list[int]]:
    """Cell indices of each line, ordered from the edge the tiles slide towards."""
    rows = [[row * 4 + column for column in range(4)] for row in range(4)]
    columns = [[row * 4 + column for row in range(4)] for column in range(4)]
    return {
        "left": rows,
        "right": [line[::-1] for line in rows],
        "up": columns,
        "down": [line[::-1] for line in columns],
    }[direction]


def board_text(board: list[int]) -> str:
    width = max(len(str(value)) for value in board) if any(board) else 1
    return "\n".join(
        " ".join((str(value) if value else ".").rjust(width) for value in board[row * 4 : row * 4 + 4])
        for row in range(4)
    )
