"""Batch-level env stepping, the synchronous baseline: every turn waits for the whole batch.

veRL-style systems step environments in lock-step: turn t+1 of any trajectory starts only when
every trajectory of the batch has finished turn t, so the slowest environment call of each turn
stalls everyone. RollArt does not do this (each trajectory is its own coroutine); the barrier
exists to measure the difference on the same code (`run.rollout.env_stepping: batch`).
"""

from __future__ import annotations

import asyncio


class TurnBarrier:
    """Releases a turn once every live trajectory of the batch has reached it."""

    def __init__(self) -> None:
        self._live = 0
        self._arrived = 0
        self._turn = asyncio.Event()

    def join(self) -> None:
        self._live += 1

    def leave(self) -> None:
        """A trajectory ended (done, failed or cancelled): the others no longer wait for it."""
        self._live -= 1
        self._release_if_complete()

    async def wait(self) -> None:
        """Arrive at the next turn and wait until the whole batch has."""
        turn = self._turn
        self._arrived += 1
        self._release_if_complete()
        await turn.wait()

    def _release_if_complete(self) -> None:
        if self._arrived and self._arrived >= self._live:
            self._turn.set()
            self._turn = asyncio.Event()
            self._arrived = 0
