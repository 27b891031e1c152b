"""When an elastic reward pool lets an idle worker go early (`release: by-gap`), in both the real pool
(`rollart.rewards.pool`) and the simulated service (`rollart.sim.reward`).

A worker idle for `idle_timeout_s` always goes (`release: idle`, the paper's rule, holds it that long
whatever comes). `by-gap` lets it go sooner, when keeping it costs more than starting one again:
- its next request is predicted further off than a cold start: requests come one every gap (an
  exponentially weighted mean of the gaps between them, or the time since the last one when that is
  longer: the stream has paused), and each idle worker waits its turn among the idle ones;
- or the recent load (busy worker-seconds over the pool's trailing window) would keep the workers left
  at most `SHED_BUSY` busy: requests then queue a little, and the pool's scale-up bounds how long.
An idle worker that stays is looked at again after a cold start.
"""

from __future__ import annotations

from typing import Literal

Release = Literal["idle", "by-gap"]

GAP_WEIGHT = 0.1
"""Weight of the newest gap between requests in their mean."""
SHED_BUSY = 0.9
"""An idle worker goes when the recent load would keep the others at most this busy."""


class Arrivals:
    """The gaps between a pool's requests."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.gap_s: float | None = None

    def record(self, now: float) -> None:
        if self.last is not None:
            gap = now - self.last
            self.gap_s = gap if self.gap_s is None else GAP_WEIGHT * gap + (1 - GAP_WEIGHT) * self.gap_s
        self.last = now

    def next_request_s(self, now: float, *, idle: int) -> float:
        """Predicted seconds until an idle worker, one of `idle`, gets its next request."""
        if self.last is None:
            return float("inf")
        return idle * max(self.gap_s or 0.0, now - self.last)


def spare(arrivals: Arrivals, now: float, *, idle: int, live: int, load: float | None, cold_start_s: float) -> bool:
    """Whether an idle worker is not worth keeping. `load`: busy workers on average over the trailing
    window (None: too little seen yet to judge it)."""
    if arrivals.next_request_s(now, idle=idle) > cold_start_s:
        return True
    return load is not None and load <= SHED_BUSY * (live - 1)
