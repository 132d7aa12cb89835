"""`tic_tac_toe`: the model plays against a random opponent; the environment is the board.

    {"kind": "tic_tac_toe", "max_turns": 5,
     "config": {"model_mark": "X", "max_invalid_moves": 0, "invalid_move_penalty": 0.1}}

Each model turn must name a free cell as `<move>B2</move>` (columns A-C, rows 1-3; the last tag in
the reply counts; with `move_format: lenient`, a reply without a tag plays its first cell name). The environment answers with a user message: the model's move, the opponent's
reply and the board. An invalid move (no tag, an unknown or taken cell) costs `invalid_move_penalty`;
after more than `max_invalid_moves` of them the model forfeits. Outcome: `{"result": win|draw|loss|
forfeit|unfinished, "reward", "moves", "invalid_moves", "board"}` with reward `reward_<result>`
(win 1, draw 0.5, loss 0, forfeit 0, unfinished 0) plus `valid_move_reward` per valid move, minus the
penalties. The opponent's random moves are seeded per trajectory (`item.seed` overrides the seed),
so a replayed step replays the same games.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from training.environments.base import (
    ConfigError,
    Environment,
    EpisodeState,
    Reply,
    _object,
    _turns,
    choice,
    game_start,
    integer,
    known_keys,
    number,
    show_board,
)
from training.rollouts.tools import ToolCall

COLUMNS = "ABC"
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
MOVE = re.compile(r"<move>\s*([A-Ca-c])\s*([1-3])\s*</move>")
ANY_MOVE_TAG = re.compile(r"<move>(.*?)</move>", re.DOTALL)
BARE_CELL = re.compile(r"\b[A-Ca-c][1-3]\b")
RESULTS = ("win", "draw", "loss", "forfeit", "unfinished")
DEFAULT_REWARDS = {"win": 1.0, "draw": 0.5, "loss": 0.0, "forfeit": 0.0, "unfinished": 0.0}
DEFAULT_SYSTEM_PROMPT = (
    "You are playing tic-tac-toe. Cells are named by column A-C and row 1-3, e.g. B2 is the centre. "
    "Answer each turn with your move as <move>CELL</move>, for example <move>B2</move>."
)
CONFIG_HELP = {
    "model_mark": "X (the model moves first) or O (the opponent moves first); default X",
    "max_invalid_moves": "invalid moves allowed before the model forfeits (default 0: the first forfeits)",
    "invalid_move_penalty": "subtracted from the reward per invalid move (default 0.1)",
    "valid_move_reward": "added to the reward per valid move (default 0)",
    "move_format": "tag (default): only <move>CELL</move> counts; lenient: without a tag, the first cell name (B2) in the reply",
    **{
        f"reward_{result}": f"reward for a {result} (default {value:g})"
        for result, value in DEFAULT_REWARDS.items()
    },
}


class TicTacToeEnvironment(Environment):
    kind: ClassVar[str] = "tic_tac_toe"
    description: ClassVar[str] = (
        "Tic-tac-toe against a random opponent; the model names its move as <move>B2</move>."
    )
    answer: ClassVar[str] = "each turn's <move>CELL</move>; the game's result is in outcome (sample.outcome)"
    default_max_turns: ClassVar[int] = 5
    config_help: ClassVar[dict[str, str]] = CONFIG_HELP

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        config = self.config
        self.model_mark: str = config.get("model_mark", "X")
        self.opponent_mark = "O" if self.model_mark == "X" else "X"
        self.max_invalid_moves: int = config.get("max_invalid_moves", 0)
        self.invalid_move_penalty: float = config.get("invalid_move_penalty", 0.1)
        self.valid_move_reward: float = config.get("valid_move_reward", 0.0)
        self.lenient: bool = config.get("move_format", "tag") == "lenient"
        self.rewards = {
            result: config.get(f"reward_{result}", value) for result, value in DEFAULT_REWARDS.items()
        }

    @classmethod
    def validate(cls, config: Any, tools: Any, max_turns: int | None) -> dict[str, Any]:
        config = _object(config, "config")
        known_keys(config, CONFIG_HELP)
        mark = choice(config, "model_mark", "X", ("X", "O"))
        invalid = integer(config, "max_invalid_moves", 0, minimum=0, maximum=20)
        choice(config, "move_format", "tag", ("tag", "lenient"))
        number(config, "invalid_move_penalty", 0.1, minimum=0)
        number(config, "valid_move_reward", 0.0, minimum=0)
        for result in DEFAULT_REWARDS:
            number(config, f"reward_{result}", DEFAULT_REWARDS[result])
        if tools not in (None, []):
            raise ConfigError("tools", "a tic_tac_toe environment takes no tools")
        # A game needs at most 5 moves from X, 4 from O, plus the invalid moves allowed.
        needed = (5 if mark == "X" else 4) + invalid
        turns = _turns(max_turns, needed)
        if turns < needed:
            raise ConfigError(
                "max_turns", f"must be at least {needed} to finish a game (the model plays {mark})"
            )
        return {"config": config, "tools": [], "max_turns": turns}

    def start(self, row: dict[str, Any], *, seed: int | None = None) -> EpisodeState:
        system_prompt = self.system_prompt or DEFAULT_SYSTEM_PROMPT
        state = game_start(row, seed=seed, system_prompt=system_prompt)
        state.data.update(board=[" "] * 9, moves=0, invalid_moves=0, result=None)
        state.metrics["invalid_moves"] = 0
        opening = ""
        if self.opponent_mark == "X":
            cell = self._opponent_move(state)
            opening = f"I played {cell_name(cell)}. "
        text = f"{opening}You play {self.model_mark}.\n{self._board_text(state)}\nYour move?"
        show_board(state, text, system_prompt=system_prompt)
        return state

    def reply(self, state: EpisodeState, text: str) -> Reply:
        board = state.data["board"]
        cell, problem = parse_move(text, board, lenient=self.lenient)
        if problem is not None:
            state.data["invalid_moves"] += 1
            state.metrics["invalid_moves"] += 1
            if state.data["invalid_moves"] > self.max_invalid_moves:
                state.data["result"] = "forfeit"
                return Reply([], done=True)
            return Reply(
                [_user(f"Invalid move: {problem}. Try again.\n{self._board_text(state)}\nYour move?")]
            )
        assert cell is not None
        board[cell] = self.model_mark
        state.data["moves"] += 1
        if winner(board) == self.model_mark:
            state.data["result"] = "win"
            return Reply([], done=True)
        if " " not in board:
            state.data["result"] = "draw"
            return Reply([], done=True)
        answer = self._opponent_move(state)
        if winner(board) == self.opponent_mark:
            state.data["result"] = "loss"
            return Reply([], done=True)
        if " " not in board:
            state.data["result"] = "draw"
            return Reply([], done=True)
        return Reply([_user(f"I played {cell_name(answer)}.\n{self._board_text(state)}\nYour move?")])

    def reply_batch(
        self, states: list[EpisodeState], texts: list[str], calls: list[list[ToolCall]]
    ) -> list[Reply]:
        return [self.reply(state, text) for state, text in zip(states, texts, strict=True)]

    def outcome(self, state: EpisodeState) -> dict[str, Any]:
        result = state.data["result"] or "unfinished"
        reward = (
            self.rewards[result]
            + self.valid_move_reward * state.data["moves"]
            - self.invalid_move_penalty * state.data["invalid_moves"]
        )
        return {
            "result": result,
            "reward": reward,
            "moves": state.data["moves"],
            "invalid_moves": state.data["invalid_moves"],
            "board": board_text(state.data["board"]),
        }

    def _opponent_move(self, state: EpisodeState) -> int:
        board = state.data["board"]
        cell = state.rng.choice([index for index, mark in enumerate(board) if mark == " "])
        board[cell] = self.opponent_mark
        return cell

    def _board_text(self, state: EpisodeState) -> str:
        board = state.data["board"]
        free = ", ".join(cell_name(index) for index, mark in enumerate(board) if mark == " ")
        return f"{board_text(board)}\nFree cells: {free}"


def _user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def cell_name(index: int) -> str:
    return f"{COLUMNS[index % 3]}{index // 3 + 1}"


def board_text(board: list[str]) -> str:
    rows = ["  A B C"]
    for row in range(3):
        rows.append(
            f"{row + 1} " + " ".join(mark if mark != " " else "." for mark in board[row * 3 : row * 3 + 3])
        )
    return "\n".join(rows)


def parse_move(text: str, board: list[str], *, lenient: bool = False) -> tuple[int | None, str | None]:
    """(cell index, None) or (None, why the move is invalid). `lenient`: a reply without a tag
    plays the first cell name in it (for small models still learning the format)."""
    tags = ANY_MOVE_TAG.findall(text)
    if not tags and lenient and (bare := BARE_CELL.search(text)):
        tags = [bare.group(0)]
    if not tags:
        return None, "no <move>CELL</move> in your reply"
    match = MOVE.fullmatch(f"<move>{tags[-1]}</move>")
    if match is None:
        return None, f"{tags[-1].strip()!r} is not a cell (A1 to C3)"
    index = (int(match.group(2)) - 1) * 3 + COLUMNS.index(match.group(1).upper())
    if board[index] != " ":
        return None, f"{cell_name(index)} is taken"
    return index, None


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None
