"""Sokoban as text: push one box onto one target in a small walled room.

Boards are made by playing backwards from the solved state (reverse play), so every one is
solvable: the box starts on the target, the player pulls it off once, then makes random reverse
moves (walk, or pull the box along) that never put the box back on the target. Each reverse move
undone is one forward move, so the puzzle is solvable in at most `max_turns` moves (the number
of reverse moves made); the shortest solution is often shorter.

Moves: the player walks into free floor or pushes the box one cell when the cell beyond it is
floor; walking into a wall, or pushing the box into one, leaves everything in place. Reward 1
when the box reaches the target (terminated); every other move gets `-step_penalty` (default 0,
so the return is 1 or 0; set e.g. 0.01 to prefer short solutions; a reply without a valid move
gets the format penalty instead). Truncated after `max_turns` moves (default 10).

Drawn in the usual Sokoban characters, with `_` for floor so that rows have no spaces; the
board of seed 0 (solved by `down`, `left`):

    ######
    #____#
    #____#
    #__@_#
    #.$__#
    ######
"""

from __future__ import annotations

import random
from typing import Unpack

from rollart.envs.base import DIRECTIONS, require
from rollart.tasks.grid import GridEnv, GridOptions, Pos, shift


class SokobanEnv(GridEnv):
    """An N x N room (walls included) with one box and one target, solvable by construction."""

    name = "sokoban"
    max_turns = 10
    intro = (
        "Sokoban: push the box $ onto the target . (you can push, never pull).\n"
        "Legend: @ you, $ box, . target, * box on target, + you on target, # wall, _ floor."
    )

    def __init__(
        self,
        *,
        size: int = 6,
        step_penalty: float = 0.0,
        **grid: Unpack[GridOptions],
    ) -> None:
        super().__init__(**grid)
        # A 3x3 floor is the smallest where a box can leave the target and still be pushed back.
        require(size >= 5, self.name, f"size must be >= 5 (walls included), got {size}")
        require(step_penalty >= 0.0, self.name, f"step_penalty must be >= 0, got {step_penalty}")
        self.size = size
        self.step_penalty = step_penalty
        self._move_reward = 0.0 - step_penalty  # 0.0, not -0.0, when there is no penalty
        self.player: Pos = (1, 1)
        self.box: Pos = (2, 2)
        self.target: Pos = (2, 2)

    def _is_floor(self, pos: Pos) -> bool:
        return 1 <= pos[0] <= self.size - 2 and 1 <= pos[1] <= self.size - 2

    def _generate(self, rng: random.Random) -> None:
        # First pull: the target, then the player one cell away in `direction`, then one more
        # floor cell beyond, so the pull is possible; every interior of 3x3 or more has such a line.
        direction = rng.choice(list(DIRECTIONS))
        floor = [(r, c) for r in range(1, self.size - 1) for c in range(1, self.size - 1)]
        lines = [
            p
            for p in floor
            if self._is_floor(shift(p, direction)) and self._is_floor(shift(shift(p, direction), direction))
        ]
        self.target = rng.choice(lines)
        self.box = shift(self.target, direction)
        self.player = shift(self.box, direction)
        moves = 1
        # Each attempt either makes one reverse move or hits a wall or the box; the cap only
        # guards against a pathological RNG stream (the player always has a free neighbour).
        for _ in range(50 * self.max_turns):
            if moves >= self.max_turns:
                break
            direction = rng.choice(list(DIRECTIONS))
            nxt = shift(self.player, direction)
            if not self._is_floor(nxt) or nxt == self.box:
                continue
            behind = shift(self.player, _OPPOSITE[direction])
            if behind == self.box and self.player != self.target and rng.random() < 0.7:
                self.box = self.player
            self.player = nxt
            moves += 1

    def _moves(self, direction: str) -> bool:
        nxt = shift(self.player, direction)
        return self._is_floor(nxt) and (nxt != self.box or self._is_floor(shift(nxt, direction)))

    def _move(self, direction: str) -> tuple[str, float, bool]:
        nxt = shift(self.player, direction)
        if not self._is_floor(nxt):
            return f"You cannot move {direction}: there is a wall.", self._move_reward, False
        if nxt == self.box:
            beyond = shift(nxt, direction)
            if not self._is_floor(beyond):
                return f"You cannot push the box {direction}: there is a wall behind it.", self._move_reward, False
            self.box = beyond
            self.player = nxt
            if self._solved():
                return f"You pushed the box {direction} onto the target. Solved!", 1.0, True
            return f"You pushed the box {direction}.", self._move_reward, False
        self.player = nxt
        return f"You moved {direction}.", self._move_reward, False

    def _solved(self) -> bool:
        return self.box == self.target

    def _cell(self, pos: Pos) -> str:
        if not self._is_floor(pos):
            return "#"
        on_target = pos == self.target
        if pos == self.box:
            return "*" if on_target else "$"
        if pos == self.player:
            return "+" if on_target else "@"
        return "." if on_target else "_"


_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
