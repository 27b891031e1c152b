"""What the grid games (FrozenLake, Sokoban) share: turns, move parsing, rendering.

A grid game is multi-turn with a long observation (the whole board every turn) and a one-word
action, so its profile is "prefill-heavy". The model answers each turn with `\\boxed{up}`,
`\\boxed{down}`, `\\boxed{left}` or `\\boxed{right}` (case-insensitive; a reply that names exactly
one direction as a bare word is accepted too, see `parse_choice`). A reply with no valid move
costs `format_penalty` and a turn, and leaves the board as it was.

Subclasses generate a board from a `random.Random` seeded with the episode seed (so the same
seed gives the same board), apply a move, and draw the board as rows of characters.
"""

from __future__ import annotations

import abc
import random

from rollart.envs.base import (
    DIRECTIONS,
    FORMAT_PENALTY,
    Env,
    Info,
    StepResult,
    not_running,
    parse_choice,
    require,
    resolve_seed,
)

Pos = tuple[int, int]
"""(row, column), row 0 at the top."""

MOVE_HINT = "Answer with \\boxed{up}, \\boxed{down}, \\boxed{left} or \\boxed{right}."

GRID_SYSTEM_PROMPT = (
    "You are playing a grid game, one move per turn. The board is drawn as rows of characters, "
    "top row first. Think briefly, then end your reply with exactly one move: "
    "\\boxed{up}, \\boxed{down}, \\boxed{left} or \\boxed{right}."
)


def shift(pos: Pos, direction: str) -> Pos:
    """The cell one step from `pos` in `direction`."""
    dr, dc = DIRECTIONS[direction]
    return pos[0] + dr, pos[1] + dc


class GridEnv(Env):
    """Turn counting, move parsing and observations for a grid game; subclasses own the board."""

    profile = "prefill-heavy"
    system_prompt = GRID_SYSTEM_PROMPT
    name = "grid"
    """The registered name, used in messages."""
    intro = ""
    """The first lines of the first observation: the goal and the legend."""

    def __init__(self, *, max_turns: int, format_penalty: float = FORMAT_PENALTY) -> None:
        require(max_turns >= 1, self.name, f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.format_penalty = format_penalty
        self._turn = 0
        self._running = False

    @abc.abstractmethod
    def _generate(self, rng: random.Random) -> None:
        """Lay out a new board from `rng`."""

    @abc.abstractmethod
    def _move(self, direction: str) -> tuple[str, float, bool]:
        """Apply a move: (what happened, in words; reward; whether the episode ended)."""

    @abc.abstractmethod
    def _rows(self) -> list[str]:
        """The board, one string per row, top row first."""

    @abc.abstractmethod
    def _solved(self) -> bool:
        """Whether the goal is reached."""

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode_seed = resolve_seed(seed)
        self._generate(random.Random(episode_seed))
        self._turn = 0
        self._running = True
        return f"{self.intro}\n{self._board()}", {"seed": episode_seed, "turn": 0}

    def step(self, action: str) -> StepResult:
        if not self._running:
            raise not_running(self.name)
        self._turn += 1
        direction = parse_choice(action, DIRECTIONS)
        if direction is None:
            feedback, reward, terminated = f"No valid move found. {MOVE_HINT}", self.format_penalty, False
        else:
            feedback, reward, terminated = self._move(direction)
        truncated = not terminated and self._turn >= self.max_turns
        self._running = not (terminated or truncated)
        info: Info = {"turn": self._turn, "format_error": direction is None, "success": self._solved()}
        return f"{feedback}\n{self._board()}", reward, terminated, truncated, info

    def _board(self) -> str:
        left = self.max_turns - self._turn
        footer = f"Turns left: {left}. {MOVE_HINT}" if self._running else "The episode is over."
        return "\n".join([*self._rows(), footer])
