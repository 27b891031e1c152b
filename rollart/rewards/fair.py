"""Fair sharing of one reward pool among the jobs (training runs) that use it.

A reward gateway can serve several runs at once (Reward-as-a-Service shared by jobs: each run's
`run.reward_service` points at it, and the gateway's `run.reward_jobs` lists them). Its workers are
one pool; which job's request a free worker takes next is decided here, by start-time fair
queueing over service time (Goyal, Vin and Cheng, 1996): each job has a virtual time, the worker
seconds it has used divided by its weight, and a free worker takes the oldest request of the job
with the least. A job that asks for little is served at once; jobs that keep the pool busy split
it by weight, whatever their request rates; a job coming back after a quiet spell starts at the
others' virtual time, so it cannot bank its idle time and then hold every worker.

A request's cost is known only when it ends, so taking one charges the job its mean cost so far
(`charge` corrects it with the real one): without that, several workers freed at once would all
go to the same job.

    queue = FairQueue({"job-a": 2.0})            # job-a weighs 2, any other job 1
    queue.push("job-b", request)
    job, request = queue.pop()
    ...                                          # the request runs for 0.7 s
    queue.charge(job, request, 0.7)

Jobs not named weigh `default_weight`; a run's own requests (a gateway of its own topology) are one
job, so a pool with one job behaves as a FIFO queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

FIRST_COST_S = 1.0
"""What taking a request charges a job before any of its requests has ended (seconds)."""


@dataclass(eq=False)
class _Job(Generic[T]):
    weight: float
    queue: deque[T] = field(default_factory=deque)
    vtime: float = 0.0
    """Worker seconds charged so far / weight."""
    charged: int = 0
    """Requests taken."""
    cost_s: float = 0.0
    """Worker seconds of the requests that ended."""
    ended: int = 0
    taken: dict[int, float] = field(default_factory=dict)
    """What each request taken and not yet ended was charged, by id."""

    def mean_cost(self) -> float:
        return self.cost_s / self.ended if self.ended else FIRST_COST_S


class FairQueue(Generic[T]):
    """Per-job FIFO queues, taken from in start-time fair order (module docstring)."""

    def __init__(self, weights: Mapping[str, float] | None = None, *, default_weight: float = 1.0) -> None:
        if default_weight <= 0 or any(w <= 0 for w in (weights or {}).values()):
            raise ValueError(f"job weights must be > 0; got {dict(weights or {})}, default {default_weight}")
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self._jobs: dict[str, _Job[T]] = {}
        self._now = 0.0
        """The virtual time of the last request taken: where a job that was idle starts again."""
        self._size = 0

    def _job(self, name: str) -> _Job[T]:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = _Job(self.weights.get(name, self.default_weight), vtime=self._now)
        return job

    def push(self, name: str, item: T) -> None:
        """Queue `item` at the back of job `name`'s queue."""
        job = self._job(name)
        if not job.queue:  # back from idle: no credit for the time it asked for nothing
            job.vtime = max(job.vtime, self._now)
        job.queue.append(item)
        self._size += 1

    def push_front(self, name: str, item: T) -> None:
        """Put back an item just taken (it could not start): it goes first again, its charge undone."""
        job = self._job(name)
        job.queue.appendleft(item)
        job.vtime -= job.taken.pop(id(item), 0.0) / job.weight
        job.charged -= 1
        self._size += 1

    def pop(self) -> tuple[str, T]:
        """The next request: the oldest of the waiting job with the least virtual time (`IndexError` if none)."""
        waiting = [(job.vtime, name) for name, job in self._jobs.items() if job.queue]
        if not waiting:
            raise IndexError("pop from an empty FairQueue")
        _, name = min(waiting)
        job = self._jobs[name]
        self._now = job.vtime
        item = job.queue.popleft()
        job.taken[id(item)] = estimate = job.mean_cost()
        job.vtime += estimate / job.weight
        job.charged += 1
        self._size -= 1
        return name, item

    def charge(self, name: str, item: T, seconds: float) -> None:
        """`item`, taken from job `name`, has ended after `seconds` of a worker: its charge becomes that."""
        job = self._job(name)
        job.cost_s += seconds
        job.ended += 1
        job.vtime += (seconds - job.taken.pop(id(item), 0.0)) / job.weight

    def remove(self, name: str, item: T) -> bool:
        """Take `item` out of job `name`'s queue (its caller gave up); whether it was there."""
        job = self._jobs.get(name)
        if job is None or item not in job.queue:
            return False
        job.queue.remove(item)
        self._size -= 1
        return True

    def depth(self, name: str) -> int:
        """Requests of job `name` waiting."""
        job = self._jobs.get(name)
        return len(job.queue) if job is not None else 0

    def drain(self) -> Iterator[tuple[str, T]]:
        """Take every waiting request (the pool is closing), job by job."""
        for name, job in self._jobs.items():
            while job.queue:
                self._size -= 1
                yield name, job.queue.popleft()

    def jobs(self) -> list[str]:
        """Every job seen, in the order first seen."""
        return list(self._jobs)

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0
