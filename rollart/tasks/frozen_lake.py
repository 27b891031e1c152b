"""FrozenLake as text: walk across an N x N lake from S to G without falling into a hole.

The board comes from the episode seed: start and goal on two random cells at least N - 1 moves
apart, then each other cell a hole with probability `hole_prob`. A board is kept only when a
breadth-first search finds a path from S to G within `max_turns` moves; after 100 rejected
boards the holes on one L-shaped path are cleared, so every episode is solvable within its
turn limit.

With `corners=True` the start is always the top-left cell and the goal the bottom-right one, as in
Gymnasium's `generate_random_map`; only the holes change with the seed.

With `layout` (rows separated by "/", e.g. Gymnasium's classic "SFFF/FHFH/FFFH/HFFG") every
episode plays that one board instead; the layout must have one S, one G and a path within
`max_turns`.

With `shaping > 0` every move also earns `shaping` times the change of a potential, minus the
shortest hole-free distance to G over the distance at the start (Ng et al. 1999: potential-based
shaping leaves the optimal policy unchanged). Over an episode that sums to `shaping` times the
fraction of the way to G that was covered, so an episode that ends closer to G scores higher
even when no episode of its group succeeds; falling into a hole earns no shaping for that move.
`info["success"]` is unchanged: only reaching G counts.

Reward 1 on reaching G (terminated), 0 for other moves; stepping into a hole terminates with 0;
a move off the edge leaves the player in place. Sample first observation (4x4, seed 0):

    You are on a frozen lake. Reach the goal G without falling into a hole H.
    Legend: P you, S start, F frozen ice, H hole, G goal.
    HFFF
    FFFG
    FFHH
    PHFF
    Turns left: 8. Answer with \\boxed{up}, \\boxed{down}, \\boxed{left} or \\boxed{right}.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Unpack

from rollart.envs.base import DIRECTIONS, require
from rollart.tasks.grid import GridEnv, GridOptions, Pos, shift

_MAX_REJECTED_BOARDS = 100


def shortest_path(holes: set[Pos], size: int, start: Pos, goal: Pos) -> list[str] | None:
    """The moves of a shortest hole-free path from `start` to `goal`, or None if there is none."""
    came_from: dict[Pos, tuple[Pos, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        pos = queue.popleft()
        if pos == goal:
            moves: list[str] = []
            step = came_from[pos]
            while step is not None:
                pos, move = step
                moves.append(move)
                step = came_from[pos]
            return moves[::-1]
        for move in DIRECTIONS:
            nxt = shift(pos, move)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in came_from:
                came_from[nxt] = (pos, move)
                queue.append(nxt)
    return None


class FrozenLakeEnv(GridEnv):
    """An N x N frozen lake, solvable within `max_turns` moves by construction."""

    name = "frozen-lake"
    max_turns = 8
    intro = (
        "You are on a frozen lake. Reach the goal G without falling into a hole H.\n"
        "Legend: P you, S start, F frozen ice, H hole, G goal."
    )

    def __init__(
        self,
        *,
        size: int = 4,
        hole_prob: float = 0.2,
        layout: str | None = None,
        corners: bool = False,
        shaping: float = 0.0,
        **grid: Unpack[GridOptions],
    ) -> None:
        super().__init__(**grid)
        self.layout = _parse_layout(layout, self.max_turns) if layout is not None else None
        self.corners = corners
        require(shaping >= 0.0, self.name, f"shaping must be >= 0, got {shaping}")
        self.shaping = shaping
        if self.layout is not None:
            size = self.layout[0]
        require(size >= 2, self.name, f"size must be >= 2, got {size}")
        require(0.0 <= hole_prob < 1.0, self.name, f"hole_prob must be in [0, 1), got {hole_prob}")
        require(
            self.max_turns >= 2 * (size - 1),
            self.name,
            f"max_turns={self.max_turns} is too few to cross a {size}x{size} lake (needs >= {2 * (size - 1)})",
        )
        self.size = size
        self.hole_prob = hole_prob
        self.start: Pos = (0, 0)
        self.goal: Pos = (size - 1, size - 1)
        self.holes: set[Pos] = set()
        self.player: Pos = self.start

    def _generate(self, rng: random.Random) -> None:
        if self.layout is not None:
            _, self.start, self.goal, holes = self.layout
            self.holes = set(holes)
            self.player = self.start
            return
        cells = [(r, c) for r in range(self.size) for c in range(self.size)]
        if self.corners:
            self.start, self.goal = (0, 0), (self.size - 1, self.size - 1)
        else:
            self.start = rng.choice(cells)
            # At least size - 1 moves apart, so that no episode is won in one step.
            far = [p for p in cells if abs(p[0] - self.start[0]) + abs(p[1] - self.start[1]) >= self.size - 1]
            self.goal = rng.choice(far)
        for _ in range(_MAX_REJECTED_BOARDS):
            self.holes = {p for p in cells if p not in (self.start, self.goal) and rng.random() < self.hole_prob}
            path = shortest_path(self.holes, self.size, self.start, self.goal)
            if path is not None and len(path) <= self.max_turns:
                break
        else:
            # Rows first, then columns: a path of Manhattan length, which the constructor
            # checked fits in max_turns.
            (r0, c0), (r1, c1) = self.start, self.goal
            path_cells = {(r, c0) for r in range(min(r0, r1), max(r0, r1) + 1)}
            path_cells |= {(r1, c) for c in range(min(c0, c1), max(c0, c1) + 1)}
            self.holes -= path_cells
        self.player = self.start

    def _move(self, direction: str) -> tuple[str, float, bool]:
        if not self.shaping:
            return self._apply(direction)
        before = self._potential()
        feedback, reward, terminated = self._apply(direction)
        if self.player not in self.holes:
            reward += self.shaping * (self._potential() - before)
        return feedback, reward, terminated

    def _potential(self) -> float:
        """-(moves left to the goal) / (moves from the start): 0 at the goal, -1 at the start."""
        left = shortest_path(self.holes, self.size, self.player, self.goal)
        first = shortest_path(self.holes, self.size, self.start, self.goal)
        return -len(left or []) / max(len(first or []), 1)

    def _apply(self, direction: str) -> tuple[str, float, bool]:
        if not self._moves(direction):
            return f"You cannot move {direction}: that is the edge of the lake.", 0.0, False
        nxt = shift(self.player, direction)
        self.player = nxt
        if nxt == self.goal:
            return f"You moved {direction} and reached the goal!", 1.0, True
        if nxt in self.holes:
            return f"You moved {direction} and fell into a hole.", 0.0, True
        return f"You moved {direction}.", 0.0, False

    def _solved(self) -> bool:
        return self.player == self.goal

    def _cell(self, pos: Pos) -> str:
        if pos == self.player:
            return "P"
        if pos == self.goal:
            return "G"
        if pos == self.start:
            return "S"
        return "H" if pos in self.holes else "F"


def _parse_layout(layout: str, max_turns: int) -> tuple[int, Pos, Pos, set[Pos]]:
    """Check a fixed board ("SFFF/FHFH/...") and return (size, start, goal, holes)."""
    name = FrozenLakeEnv.name
    rows = layout.strip().split("/")
    size = len(rows)
    square = size >= 2 and all(len(row) == size for row in rows)
    require(square, name, f"layout must be a square of rows, got {layout!r}")
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    bad = sorted({ch for ch in cells.values() if ch not in "SFHG"})
    require(not bad, name, f"layout may only use S, F, H and G, found {''.join(bad)!r}")
    starts = [p for p, ch in cells.items() if ch == "S"]
    goals = [p for p, ch in cells.items() if ch == "G"]
    require(len(starts) == 1 and len(goals) == 1, name, "layout needs exactly one S and one G")
    holes = {p for p, ch in cells.items() if ch == "H"}
    path = shortest_path(holes, size, starts[0], goals[0])
    require(path is not None, name, f"layout {layout!r} has no path from S to G")
    assert path is not None
    require(len(path) <= max_turns, name, f"layout {layout!r} needs {len(path)} moves, more than max_turns={max_turns}")
    return size, starts[0], goals[0], holes
