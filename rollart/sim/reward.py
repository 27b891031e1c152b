"""The simulated reward: an LLM judge's scoring time, on dedicated local GPUs or an elastic service.

`SimRewardPool` stands where the reward gateway's `RewardPool` does (same `score`, `stats`,
`async with`) when `run.sim.reward` is set. The reward *value* is still the registered function's
(called inline: the functions simulated tasks use are cheap); what is simulated is the time a
reward model (`run.sim.reward.model`, by default Qwen2.5-7B) takes to read the trajectory
(prefill of `ScoreInput.tokens`) and write a short verdict (`verdict_tokens` decode steps), on one GPU
per worker, timed by the same `CostModel` as the engines.

Placements (the paper's Fig. 14 compares the first two):
- `local`: `workers` GPUs reserved for the reward model for the whole run, each serving one
  request at a time; requests queue when all are busy. The GPUs count as live from start to end.
- `service`: Reward-as-a-Service. Workers start on demand (a `cold_start_s` wait before the
  first request they serve), up to `workers`: by default one more when the queue's work, shared
  among the workers there are, would keep its last request waiting longer than a cold start
  (`scale_up: by-wait`), or one per waiting request (`per-request`); a worker idle for
  `idle_timeout_s` is released (down to `min_workers`, zero allowed), or with `release: by-gap` one
  whose next request is predicted further off than a start or whom the recent load does not need
  (`rollart.rewards.release`). With `warm_start_s` the service keeps the judge's weights in its hosts'
  memory after its first cold start, and later starts take `warm_start_s` (loading them onto a GPU):
  releasing then weighs that shorter start, while scaling up still waits for a queue of a cold start's
  work per worker, so the workers follow the load rather than every burst.
  A worker is live, and billed, from its start to its release.
- `instant`: no reward model: the verdict at once (rule-based rewards cost next to nothing).

Utilization is busy worker-seconds over live worker-seconds, as `RewardPool` reports it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import structlog

from rollart.clock import SimClock
from rollart.errors import DeadlineExceeded
from rollart.rewards.base import RewardError, ScoreInput, ScoreOutput, get_reward
from rollart.rewards.fair import FairQueue
from rollart.rewards.release import Arrivals, spare
from rollart.rewards.stats import PoolMeters, PoolStats, State
from rollart.sim.config import SimRewardSpec
from rollart.sim.hardware import CostModel, EngineShape

log = structlog.get_logger("rollart.sim.reward")


@dataclass(eq=False)
class _Worker:
    wid: int
    spawned_at: float
    state: State = State.STARTING
    busy_since: float = 0.0
    idle_since: float = 0.0
    retire: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Job:
    tokens: int
    output: ScoreOutput
    done: asyncio.Future[None]
    owner: str
    """The training run that asked (`rollart.rewards.fair`)."""
    queued_at: float
    started: bool = False


@dataclass
class SimRewardPool:
    """Simulated reward workers on the simulation clock."""

    spec: SimRewardSpec
    clock: SimClock
    meters: PoolMeters = field(default_factory=lambda: PoolMeters(window_s=30.0))
    job_weights: dict[str, float] = field(default_factory=dict)
    """The jobs' shares when several share the pool (`rollart.rewards.fair`; default 1 each)."""
    _queue: FairQueue[_Job] = field(init=False)
    _queued_s: float = 0.0
    """Simulated seconds of work waiting in `_queue` (kept as it changes: `_pump` reads it on every event)."""
    _workers: list[_Worker] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _running: bool = False
    _started_at: float = 0.0
    _arrivals: Arrivals = field(default_factory=Arrivals)
    _cached: bool = False
    """Whether the judge's weights are in the hosts' memory (`warm_start_s`): once a first start has loaded them."""

    def __post_init__(self) -> None:
        self._queue = FairQueue(self.job_weights)
        self.cost = CostModel.build(EngineShape(gpu=self.spec.gpu, gpus=self.spec.gpus_per_worker), self.spec.model)

    def score_s(self, tokens: int) -> float:
        """Simulated seconds one worker takes to score a trajectory of `tokens` tokens."""
        verdict = self.spec.verdict_tokens
        return self.cost.prefill_s(tokens) + verdict * self.cost.decode_step_s(1, tokens + verdict // 2)

    async def __aenter__(self) -> SimRewardPool:
        self._running, self._started_at = True, self.clock.now()
        floor = {"local": self.spec.workers, "service": self.spec.min_workers, "instant": 0}[self.spec.placement]
        for _ in range(floor):
            self._start_worker(cold=self.spec.placement == "service")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._running = False
        for task in list(self._tasks):
            task.cancel()
        for w in list(self._workers):
            self._release(w)
        for _, job in self._queue.drain():
            if not job.done.done():
                job.done.set_exception(RewardError("reward pool is closed"))

    async def score(self, fn_name: str, item: ScoreInput, *, timeout: float, job: str = "") -> ScoreOutput:
        """The registered function's verdict on `item`, after the simulated judge's time on a worker, for `job`."""
        if not self._running:
            raise RewardError("reward pool is not started")
        output = get_reward(fn_name)(item)  # UnknownReward / the function's own RewardError: at once
        if self.spec.placement == "instant":
            self.meters.count(job, served=True)
            return output
        now = self.clock.now()
        self._arrivals.record(now)
        request = _Job(item.tokens, output, asyncio.get_running_loop().create_future(), job, now)
        self._queue.push(job, request)
        self._queued_s += self.score_s(request.tokens)
        self._pump()
        try:
            async with asyncio.timeout(timeout):
                await request.done
        except TimeoutError:
            self.meters.count(job, served=False)
            self.meters.timed_out += 1
            where = "was running" if request.started else "was still queued"
            raise DeadlineExceeded(f"reward {fn_name!r} did not finish within {timeout:g} s ({where})") from None
        finally:
            if not request.started and self._queue.remove(job, request):
                self._queued_s -= self.score_s(request.tokens)
        self.meters.count(job, served=True)
        return output

    def stats(self) -> PoolStats:
        return self.meters.snapshot(self._workers, queue=self._queue, now=self.clock.now())

    # -- workers ----------------------------------------------------------------------------------

    def _pump(self) -> None:
        for w in self._workers:
            if not self._queue:
                break
            if w.state is State.IDLE:
                self._serve(w, *self._queue.pop())
        if self.spec.placement != "service":
            return
        if self.spec.scale_up == "per-request":  # one worker on its way per request waiting, up to `workers`
            starting = sum(w.state is State.STARTING for w in self._workers)
            while len(self._queue) > starting and len(self._workers) < self.spec.workers:
                self._start_worker(cold=True)
                starting += 1
            return
        # by-wait: shared among the workers there are (or coming), the queue's work would keep its last
        # request waiting longer than a cold start takes: one more worker serves it sooner.
        while self._queue and len(self._workers) < self.spec.workers:
            if self._workers and self._queued_s / len(self._workers) <= self.spec.cold_start_s:
                break
            self._start_worker(cold=True)

    @property
    def start_s(self) -> float:
        """What starting a worker takes now: a cold start, or a warm one once the weights are cached."""
        warm = self.spec.warm_start_s
        return warm if warm is not None and self._cached else self.spec.cold_start_s

    def _start_worker(self, *, cold: bool) -> None:
        w = _Worker(next(self._ids), self.clock.now())
        self._workers.append(w)
        self.meters.peak = max(self.meters.peak, len(self._workers))
        self._spawn(self._warm_up(w, self.start_s if cold else 0.0))

    async def _warm_up(self, w: _Worker, seconds: float) -> None:
        await self.clock.sleep(seconds)
        self._cached = True  # its load brought the weights into the hosts' memory for the next starts
        self.meters.cold.add(seconds)
        self._idle(w)
        self._pump()

    def _serve(self, w: _Worker, owner: str, job: _Job) -> None:
        if w.retire is not None:
            w.retire.cancel()
            w.retire = None
        w.state, w.busy_since, job.started = State.BUSY, self.clock.now(), True
        self._queued_s -= self.score_s(job.tokens)
        self.meters.started(owner, w.busy_since - job.queued_at)
        self._spawn(self._work(w, job))

    async def _work(self, w: _Worker, job: _Job) -> None:
        await self.clock.sleep(self.score_s(job.tokens))
        now = self.clock.now()
        self.meters.busy.close(w.busy_since, now)
        self.meters.ran(job.owner, now - w.busy_since)
        self._queue.charge(job.owner, job, now - w.busy_since)
        if not job.done.done():
            job.done.set_result(None)
        self._idle(w)
        self._pump()

    def _idle(self, w: _Worker) -> None:
        w.state, w.idle_since = State.IDLE, self.clock.now()
        if self.spec.placement != "service":
            return
        if self.spec.release == "by-gap" and not self._queue:
            self._retire(w)
            return
        self._retire_later(w)

    def _retire_later(self, w: _Worker) -> None:
        after = self.spec.idle_timeout_s
        if self.spec.release == "by-gap":  # look again after a start's time, and release at idle_timeout_s anyway
            after = min(after - (self.clock.now() - w.idle_since), self.start_s)
        w.retire = asyncio.get_running_loop().call_later(max(0.0, after) / self.clock.speedup, self._retire, w)

    def _retire(self, w: _Worker) -> None:
        w.retire = None
        if w.state is not State.IDLE or len(self._workers) <= self.spec.min_workers:
            return
        now = self.clock.now()
        timed_out = now - w.idle_since >= self.spec.idle_timeout_s - 1e-9
        if self.spec.release == "idle" or timed_out or self._spare(now):
            self._release(w)
        else:
            self._retire_later(w)

    def _spare(self, now: float) -> bool:
        """`release: by-gap` (`rollart.rewards.release`)."""
        window = min(self.meters.busy.window_s, now - self._started_at)
        load = None
        if window >= self.start_s:
            busy = [w.busy_since for w in self._workers if w.state is State.BUSY]
            load = self.meters.busy.in_window(busy, now) / window
        idle = sum(w.state is State.IDLE for w in self._workers)
        return spare(self._arrivals, now, idle=idle, live=len(self._workers), load=load, cold_start_s=self.start_s)

    def _release(self, w: _Worker) -> None:
        if w.retire is not None:
            w.retire.cancel()
        now = self.clock.now()
        if w.state is State.BUSY:
            self.meters.busy.close(w.busy_since, now)
        self.meters.live.close(w.spawned_at, now)
        self._workers.remove(w)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
