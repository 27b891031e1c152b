"""What the grid games (FrozenLake, Sokoban) share: turns, move parsing, rendering.

A grid game is multi-turn with a long observation (the whole board every turn) and a one-word
action, so its profile is "prefill-heavy". With `actions="words"` (the default) the model answers
each turn with `\\boxed{up}`, `\\boxed{down}`, `\\boxed{left}` or `\\boxed{right}` (case-insensitive;
a reply that names exactly one direction as a bare word is accepted too, see `parse_choice`).
With `actions="letters"` it answers with one letter, U, D, L or R (the first non-blank character
of the reply decides): one generated token per turn with a character-level tokenizer, which is
what a tiny model trained from scratch can learn in minutes. A reply with no valid move costs
`format_penalty` and a turn, and leaves the board as it was.

With `compact=True` every observation is the board alone (the goal, legend and move hint go to
the system prompt once, and there is no feedback line or turn counter): a 4x4 lake costs about
60 tokens a turn instead of about 200, which is what makes multi-turn training on a CPU fast.
With `position=True` the board is followed by the player's cell in words ("You are at row 2,
column 3."), the observation Gymnasium's FrozenLake gives as a number: a tiny model reads it far
sooner than it learns to find P in the drawing.

Subclasses generate a board from a `random.Random` seeded with the episode seed (so the same
seed gives the same board), apply a move, and draw each cell of the board as a character.
"""

from __future__ import annotations

import abc
import random
from typing import Literal, TypedDict

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
LETTER_HINT = "Answer U, D, L or R."
LETTERS = {"u": "up", "d": "down", "l": "left", "r": "right"}
Actions = Literal["words", "letters"]

GRID_SYSTEM_PROMPT = (
    "You are playing a grid game, one move per turn. The board is drawn as rows of characters, "
    "top row first. Think briefly, then end your reply with exactly one move: "
    "\\boxed{up}, \\boxed{down}, \\boxed{left} or \\boxed{right}."
)

LETTER_SYSTEM_PROMPT = (
    "You are playing a grid game, one move per turn. The board is drawn as rows of characters, "
    "top row first. Reply with one letter: U (up), D (down), L (left) or R (right)."
)


def parse_letter(text: str) -> str | None:
    """The direction a one-letter reply picks: its first non-blank character, U, D, L or R."""
    stripped = text.strip()
    return LETTERS.get(stripped[0].lower()) if stripped else None


def shift(pos: Pos, direction: str) -> Pos:
    """The cell one step from `pos` in `direction`."""
    dr, dc = DIRECTIONS[direction]
    return pos[0] + dr, pos[1] + dc


class GridOptions(TypedDict, total=False):
    """What every grid game takes besides its board's own options (keywords of a task's `env_kwargs`);
    a game's `__init__` takes them as `**grid: Unpack[GridOptions]`, and the env registry checks their
    names as it checks the game's own."""

    max_turns: int
    """Moves before the episode is cut (default: the game's `max_turns`)."""
    format_penalty: float
    """Reward of a reply with no valid move, which ends the episode."""
    actions: Actions
    """words: up/down/left/right; letters: U/D/L/R."""
    compact: bool
    """A one-line system prompt (for a tiny model that cannot read instructions)."""
    position: bool
    """Say the player's row and column in each observation."""


class GridEnv(Env):
    """Turn counting, move parsing and observations for a grid game; subclasses own the board."""

    profile = "prefill-heavy"
    system_prompt = GRID_SYSTEM_PROMPT
    name = "grid"
    """The registered name, used in messages."""
    intro = ""
    """The first lines of the first observation: the goal and the legend."""
    player: Pos
    """The player's cell; subclasses keep it up to date."""
    size: int
    """The board is `size` x `size` cells; subclasses set it."""

    def __init__(
        self,
        *,
        max_turns: int | None = None,
        format_penalty: float = FORMAT_PENALTY,
        actions: Actions = "words",
        compact: bool = False,
        position: bool = False,
    ) -> None:
        max_turns = type(self).max_turns if max_turns is None else max_turns
        require(max_turns >= 1, self.name, f"max_turns must be >= 1, got {max_turns}")
        require(actions in ("words", "letters"), self.name, f"actions must be 'words' or 'letters', got {actions!r}")
        self.actions = actions
        self.compact = compact
        self.position = position
        self.hint = MOVE_HINT if actions == "words" else LETTER_HINT
        self.system_prompt = GRID_SYSTEM_PROMPT if actions == "words" else LETTER_SYSTEM_PROMPT
        if compact:
            self.system_prompt = f"{self.intro}\n{self.hint}"
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
    def _cell(self, pos: Pos) -> str:
        """The character that draws the cell at `pos`."""

    @abc.abstractmethod
    def _solved(self) -> bool:
        """Whether the goal is reached."""

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode_seed = resolve_seed(seed)
        self._generate(random.Random(episode_seed))
        self._turn = 0
        self._running = True
        first = self._board() if self.compact else f"{self.intro}\n{self._board()}"
        return first, {"seed": episode_seed, "turn": 0}

    def step(self, action: str) -> StepResult:
        if not self._running:
            raise not_running(self.name)
        self._turn += 1
        direction = parse_choice(action, DIRECTIONS) if self.actions == "words" else parse_letter(action)
        if direction is None:
            feedback, reward, terminated = f"No valid move found. {self.hint}", self.format_penalty, False
        else:
            feedback, reward, terminated = self._move(direction)
        truncated = not terminated and self._turn >= self.max_turns
        self._running = not (terminated or truncated)
        info: Info = {"turn": self._turn, "format_error": direction is None, "success": self._solved()}
        observation = self._board() if self.compact else f"{feedback}\n{self._board()}"
        return observation, reward, terminated, truncated, info

    def _moves(self, direction: str) -> bool:
        """Whether `direction` changes the board (here: it stays on it); subclasses add their walls."""
        row, col = shift(self.player, direction)
        return 0 <= row < self.size and 0 <= col < self.size

    def sample_action(self, rng: random.Random) -> str | None:
        """A uniformly random move among those that move: the rules of motion (edges, walls), never
        the board's holes, goal, box or target. A move that changes nothing is a wasted turn, as a
        malformed reply is; and its targets depend on where the player stands, so the format warm-up
        also teaches the model to find P on the board, which RL from a board-blind start had to
        discover by chance (docs/training.md, "Where the lake's plateau came from")."""
        moving = [direction for direction in DIRECTIONS if self._moves(direction)] or list(DIRECTIONS)
        direction = rng.choice(moving)
        return direction[0].upper() if self.actions == "letters" else f"\\boxed{{{direction}}}"

    def _rows(self) -> list[str]:
        """The board, one string per row, top row first."""
        return ["".join(self._cell((r, c)) for c in range(self.size)) for r in range(self.size)]

    def _board(self) -> str:
        rows = self._rows()
        if self.position:
            rows.append(f"You are at row {self.player[0] + 1}, column {self.player[1] + 1}.")
        if self.compact:
            return "\n".join(rows)
        left = self.max_turns - self._turn
        footer = f"Turns left: {left}. {self.hint}" if self._running else "The episode is over."
        return "\n".join([*rows, footer])
