"""The simulation clock: simulated seconds on top of the event loop's clock, `speedup` times faster.

Everything simulated (an engine's prefill and decode steps, an environment's reset and step, a
training step, a weight transfer) waits through `SimClock.sleep(seconds)`, in simulated seconds;
the loop sleeps `seconds / speedup` of its own time. With a speedup of 10 a 60 s simulated rollout
takes 6 s, and every duration a node measures with its own clock is 1/10 of the simulated one,
so ratios between runs at the same speedup are unchanged. On a virtual-time event loop (the
in-process mode) the loop's clock itself jumps ahead when nothing is ready, and speedup stays 1.
"""

from __future__ import annotations

import asyncio

import looptime


class SimClock:
    """Simulated time for one process."""

    def __init__(self, speedup: float = 1.0) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.speedup = speedup
        self._started: float | None = None

    def _loop_time(self) -> float:
        now = asyncio.get_running_loop().time()
        if self._started is None:
            self._started = now
        return now

    def now(self) -> float:
        """Simulated seconds since the clock was first read."""
        now = self._loop_time()
        assert self._started is not None
        return (now - self._started) * self.speedup

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of simulated time."""
        self._loop_time()
        await asyncio.sleep(max(0.0, seconds) / self.speedup)

    async def sleep_until(self, deadline: float) -> None:
        """Wait until simulated time `deadline`: a component that keeps its own timeline (each step
        ends where the last one did, plus its cost) sleeps this way, so the loop's overhead between
        steps is absorbed instead of adding up."""
        await asyncio.sleep(max(0.0, deadline - self.now()) / self.speedup)


def virtual_event_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose clock jumps ahead whenever nothing is ready (looptime): sleeps end at
    once, in order, and the loop's time reads as if they had passed. For `asyncio.Runner(loop_factory=...)`."""
    # noop_cycles: looptime first spins this many empty cycles before each jump, in case I/O
    # arrives; nothing here waits on I/O, and the default (42) was most of the loop's work.
    return looptime.new_event_loop(start=0.0, noop_cycles=0)
