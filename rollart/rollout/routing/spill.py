"""The spill controller of finish-time routing: per hardware class, the fraction of its calls that may
leave it for another class's generators.

A continuous-batching engine does not queue when loaded, it slows down; so a class's backlog alone does
not show that it is overloaded, and routing every call to where it is predicted to finish first takes
decode work to a class that is quick at it while lightly loaded and costly per token (docs/topology.md,
`run.rollout.routing`). Instead each class's spill follows the recent busy fractions the generators
report with each reply: up by `SPILL_STEP` every `SPILL_EVERY_S` while the class is `SATURATED` and
another is `SPILL_GAP` less busy, down once the two are within `SPILL_HOLD` (or it has room itself).
"""

from __future__ import annotations

from rollart.rollout.routing.base import Pool

SATURATED = 0.9
"""A hardware class this busy (its generators' recent busy fraction, on average) has no room to spare."""
SPILL_GAP = 0.15
"""Calls spill out of a saturated class while another is at least this much less busy..."""
SPILL_HOLD = 0.05
"""...and spill less once the gap is below this (between the two, the spill holds)."""
SPILL_STEP = 0.05
SPILL_MAX = 0.9
SPILL_EVERY_S = 2.0
"""How often (the loop's clock) the spill fractions move, by `SPILL_STEP`, within 0 and `SPILL_MAX`."""


class SpillController:
    """Moves each class's spill fraction by how busy the classes report they are."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.fractions: dict[str, float] = dict.fromkeys(pool.classes, 0.0)
        """Per hardware class: the fraction of its calls whose candidates include the other classes."""
        self._moved_at = 0.0

    def observe(self, now: float) -> None:
        """A call was measured at `now` (the loop's clock): move the fractions if `SPILL_EVERY_S` passed."""
        if now - self._moved_at >= SPILL_EVERY_S:
            self._moved_at = now
            self.move()

    def move(self) -> None:
        """Each class's spill follows how busy it is against the least busy other class: up while it is
        saturated and that one has room, down once they are near level (or it has room itself)."""
        busy = {
            hardware: sum(reports) / len(reports)
            for hardware, pool in self.pool.by_class.items()
            if (reports := [g.busy for g in pool if g.busy is not None])
        }
        for hardware, mine in busy.items():
            others = [other for name, other in busy.items() if name != hardware]
            if not others:
                continue
            gap, spill = mine - min(others), self.fractions[hardware]
            if mine >= SATURATED and gap >= SPILL_GAP:
                spill = min(SPILL_MAX, spill + SPILL_STEP)
            elif mine < SATURATED - SPILL_HOLD or gap < SPILL_HOLD:
                spill = max(0.0, spill - SPILL_STEP)
            self.fractions[hardware] = spill

    def describe(self) -> dict[str, float]:
        return {hardware: round(fraction, 3) for hardware, fraction in self.fractions.items()}
