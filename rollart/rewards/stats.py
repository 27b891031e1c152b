"""The reward pool's numbers: what `RewardPool.stats()` returns and the meters behind it.

Utilization is busy worker-seconds over live worker-seconds, where a worker is live from its
spawn to its exit (cold start included: a pool that keeps starting workers it then barely uses
is wasting them) and busy while it runs a job. It is reported since the pool started and over a
trailing window (30 s by default), the figure a scaling policy or the admin page wants.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgspec

from rollart.rewards.fair import FairQueue


class State(enum.Enum):
    """Where a worker is in its life (the simulated pool's workers use the first three)."""

    STARTING = enum.auto()  # spawned, not ready yet (cold start)
    IDLE = enum.auto()  # ready, no job
    BUSY = enum.auto()  # running a job
    RETIRING = enum.auto()  # told to stop (idle timeout, pool close); its exit is expected
    BROKEN = enum.auto()  # its socket failed, or it sent what it should not (killed); waiting for its exit


class MeteredWorker(Protocol):
    """What the meters read of a worker, real or simulated."""

    @property
    def state(self) -> State: ...
    @property
    def spawned_at(self) -> float: ...
    @property
    def busy_since(self) -> float: ...


class ColdStartStats(msgspec.Struct, frozen=True, kw_only=True):
    """Spawn-to-ready times of the pool's workers."""

    count: int = 0
    """Workers that became ready."""
    last_s: float = 0.0
    """The latest worker's cold start, seconds."""
    mean_s: float = 0.0
    """Mean cold start, seconds."""
    max_s: float = 0.0
    """Slowest cold start, seconds."""


class JobStats(msgspec.Struct, frozen=True, kw_only=True):
    """One job's use of a pool that several share (`rollart.rewards.fair`)."""

    weight: float
    """Its share of the workers when every job wants more than it gets, relative to the others'."""
    queue_depth: int
    """Its requests waiting for a worker."""
    served: int
    failed: int
    busy_s: float
    """Worker seconds its requests used."""
    share: float
    """Its `busy_s` over every job's."""
    wait_mean_s: float
    """Mean queue wait of its requests that reached a worker, seconds."""


class PoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a `RewardPool`."""

    live_workers: int
    """Workers starting, idle or busy (not the ones retiring)."""
    starting_workers: int
    """Workers spawned that have not reported ready yet."""
    busy_workers: int
    """Workers running a job."""
    idle_workers: int
    """Workers ready and waiting."""
    peak_workers: int
    """Most live workers at any moment since start."""
    queue_depth: int
    """Requests waiting for a worker."""
    served: int
    """Requests answered with a reward."""
    failed: int
    """Requests that raised: bad input, failing function, crash, timeout, pool closed."""
    timed_out: int
    """Of `failed`, those whose deadline passed."""
    crashed: int
    """Workers that died unexpectedly (during start, while idle, or mid-job)."""
    cold_starts: ColdStartStats
    """Spawn-to-ready times."""
    utilization: float
    """Busy worker-seconds / live worker-seconds since start (0 when nothing ran)."""
    utilization_window: float
    """The same over the trailing window."""
    window_s: float
    """Length of that window, seconds."""
    jobs: dict[str, JobStats] = msgspec.field(default_factory=dict)
    """Each job's share, by job name (a pool of one run's own has one job)."""


class ColdStartMeter:
    """Running count, last, mean and max of cold starts."""

    def __init__(self) -> None:
        self._count = 0
        self._total = 0.0
        self._last = 0.0
        self._max = 0.0

    def add(self, seconds: float) -> None:
        self._count += 1
        self._total += seconds
        self._last = seconds
        self._max = max(self._max, seconds)

    def snapshot(self) -> ColdStartStats:
        mean = self._total / self._count if self._count else 0.0
        return ColdStartStats(count=self._count, last_s=self._last, mean_s=mean, max_s=self._max)


class IntervalMeter:
    """Summed length of time intervals, overall and within a trailing window.

    Closed intervals are added as they end, so their ends arrive in order and the window can
    be pruned from the left; open intervals (still running) are passed in by start time.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._closed_total = 0.0
        self._recent: deque[tuple[float, float]] = deque()

    def close(self, start: float, end: float) -> None:
        self._closed_total += end - start
        self._recent.append((start, end))

    def total(self, open_starts: Iterable[float], now: float) -> float:
        return self._closed_total + sum(now - s for s in open_starts)

    def in_window(self, open_starts: Iterable[float], now: float) -> float:
        lo = now - self.window_s
        while self._recent and self._recent[0][1] <= lo:
            self._recent.popleft()
        closed = sum(end - max(start, lo) for start, end in self._recent)
        return closed + sum(now - max(s, lo) for s in open_starts)


class JobMeter:
    """What one job's requests did in the pool."""

    def __init__(self) -> None:
        self.served = self.failed = self.started = 0
        self.busy_s = self.wait_s = 0.0


class PoolMeters:
    """Everything the pool counts and times; `snapshot` turns it and the workers' state into `PoolStats`."""

    def __init__(self, window_s: float) -> None:
        self.cold = ColdStartMeter()
        self.live = IntervalMeter(window_s)
        self.busy = IntervalMeter(window_s)
        self.served = self.failed = self.timed_out = self.crashed = self.peak = 0
        self.jobs: dict[str, JobMeter] = {}

    def job(self, name: str) -> JobMeter:
        meter = self.jobs.get(name)
        if meter is None:
            meter = self.jobs[name] = JobMeter()
        return meter

    def started(self, name: str, waited_s: float) -> None:
        """A request of job `name` reached a worker after `waited_s` in the queue."""
        meter = self.job(name)
        meter.started += 1
        meter.wait_s += waited_s

    def ran(self, name: str, busy_s: float) -> None:
        """A request of job `name` that reached a worker has left it after `busy_s`."""
        self.job(name).busy_s += busy_s

    def count(self, name: str, *, served: bool) -> None:
        """A request of job `name` was answered with a reward (`served`) or failed."""
        meter = self.job(name)
        if served:
            meter.served += 1
            self.served += 1
        else:
            meter.failed += 1
            self.failed += 1

    def job_stats(self, queue: FairQueue[Any]) -> dict[str, JobStats]:
        names = dict.fromkeys([*queue.jobs(), *self.jobs])
        meters = {name: self.job(name) for name in names}
        total = sum(m.busy_s for m in meters.values())
        return {
            name: JobStats(
                weight=queue.weights.get(name, queue.default_weight),
                queue_depth=queue.depth(name),
                served=m.served,
                failed=m.failed,
                busy_s=m.busy_s,
                share=ratio(m.busy_s, total),
                wait_mean_s=m.wait_s / m.started if m.started else 0.0,
            )
            for name, m in meters.items()
        }

    def snapshot(
        self,
        workers: Sequence[MeteredWorker],
        *,
        queue: FairQueue[Any],
        now: float | None = None,
    ) -> PoolStats:
        """`workers`: every worker the pool holds (a retiring one is live until it exits); `queue`: the
        requests waiting; `now` on the clock of their times (default `time.monotonic()`)."""
        now = time.monotonic() if now is None else now
        starting, idle, busy = (
            sum(w.state is state for w in workers) for state in (State.STARTING, State.IDLE, State.BUSY)
        )
        live_since = [w.spawned_at for w in workers]
        busy_since = [w.busy_since for w in workers if w.state is State.BUSY]
        return PoolStats(
            live_workers=starting + idle + busy,
            starting_workers=starting,
            busy_workers=busy,
            idle_workers=idle,
            peak_workers=self.peak,
            cold_starts=self.cold.snapshot(),
            crashed=self.crashed,
            queue_depth=len(queue),
            served=self.served,
            failed=self.failed,
            timed_out=self.timed_out,
            utilization=ratio(self.busy.total(busy_since, now), self.live.total(live_since, now)),
            utilization_window=ratio(self.busy.in_window(busy_since, now), self.live.in_window(live_since, now)),
            window_s=self.live.window_s,
            jobs=self.job_stats(queue),
        )


def ratio(num: float, den: float) -> float:
    """num / den, 0 for an empty denominator, clipped to [0, 1] against clock rounding."""
    return min(1.0, max(0.0, num / den)) if den > 0 else 0.0
