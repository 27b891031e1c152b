"""`RewardPool`: Reward-as-a-Service on one host, an elastic pool of reward worker processes.

Requests wait in a queue per job (the training run that asked: one, unless the gateway is shared
by several runs) and go to an idle worker (the most recently used first, so the others stay idle
long enough to retire), the jobs sharing the workers fairly by weight (`rollart.rewards.fair`).
The pool grows by one worker while the queue is deeper than `scale_up_queue_per_worker` x live
workers, up to `max_workers`; a worker idle for `idle_timeout_s` retires unless that would leave
fewer than `min_workers` (with `release="by-gap"` sooner, once its next request is predicted further
off than a cold start or the recent load does not need it: `rollart.rewards.release`). With
`min_workers=0` an idle pool costs nothing and the next request pays a cold start, which is
measured (spawn to the worker's `Ready`).

Workers are fresh interpreters on one end of a socket pair (`rollart.workers`), each with an
environment without the gateway's credentials and under `limits` (CPU seconds, address space, open
files); a worker past `RETIRE_AT` of its CPU seconds is replaced after its job. What a worker sends
is decoded into the reply types of `rollart.rewards.wire`, never unpickled: a reply that is too
long, not a reply, or not the one due (another job's) fails the job it was running, naming the
worker, and the pool kills that worker (it counts as crashed) and goes on with a fresh one.

Everything is event driven on the caller's loop, with no thread and no polling: the loop watches
each worker's socket (`add_reader`) for replies and its process (a pidfd) for its exit; idle
retirement is a `call_later` timer per idle worker. `close()` removes all of them.

    async with RewardPool(min_workers=0, max_workers=4) as pool:
        out = await pool.score("exact-answer", ScoreInput(task="math", prompt=p, response=r, answer="42"),
                               timeout=30.0)

One piece: the queue, the fair share between jobs, the scaling and every worker's life are one state
machine on the event loop; each decision reads what the others just changed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence

import structlog

from rollart.errors import ConfigError, DeadlineExceeded
from rollart.rewards.base import RewardError, ScoreInput, ScoreOutput, get_reward, reference
from rollart.rewards.config import REWARD_WORKER_LIMITS
from rollart.rewards.fair import FairQueue
from rollart.rewards.handles import Request, Worker, stop_workers
from rollart.rewards.release import Arrivals, Release, spare
from rollart.rewards.stats import PoolMeters, PoolStats, State
from rollart.rewards.wire import Done, Failed, Job, Ready, Reply, StartFailed, request_encoder, tag_of
from rollart.workers.framing import frame
from rollart.workers.limits import WorkerLimits, child_environ, exit_cause
from rollart.workers.spawn import NO_SANDBOX, Launch

log = structlog.get_logger("rollart.rewards.pool")

_LIVE = (State.STARTING, State.IDLE, State.BUSY)
RETIRE_AT = 0.5
"""Share of `limits.cpu_time_s` after which a worker is replaced once its job is done."""


class RewardPool:
    """An elastic pool of reward worker processes, driven from one asyncio loop."""

    def __init__(
        self,
        min_workers: int = 0,
        max_workers: int = 4,
        scale_up_queue_per_worker: int = 2,
        idle_timeout_s: float = 5.0,
        *,
        preload: Sequence[str] = (),
        window_s: float = 30.0,
        limits: WorkerLimits = REWARD_WORKER_LIMITS,
        environ: Mapping[str, str] | None = None,
        launch: Launch = NO_SANDBOX,
        job_weights: Mapping[str, float] | None = None,
        release: Release = "idle",
    ) -> None:
        """`preload`: modules each worker imports before it reports ready (e.g. "torch"), so the
        import is part of the measured cold start instead of the first request's latency.
        `environ`: the workers' environment (default: `child_environ(os.environ)`); `launch`: their
        interpreter and sandbox (`rollart.workers.sandbox.worker_launch`; default: the node's, none).
        `job_weights`: the jobs' shares of the workers when several want more (default 1 each)."""
        self.launch = launch
        if not 0 <= min_workers <= max_workers or max_workers < 1:
            raise ConfigError(
                f"reward pool: need 0 <= min_workers <= max_workers >= 1, got {min_workers}, {max_workers}"
            )
        if scale_up_queue_per_worker < 1 or idle_timeout_s <= 0:
            raise ConfigError("reward pool: scale_up_queue_per_worker must be >= 1 and idle_timeout_s > 0")
        if problems := limits.validate():
            raise ConfigError("reward pool: " + "; ".join(f"limits.{key}: {problem}" for key, problem in problems))
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.scale_up_queue_per_worker = scale_up_queue_per_worker
        self.idle_timeout_s = idle_timeout_s
        self.release = release
        self._arrivals = Arrivals()
        self._started_at = 0.0
        self.preload = tuple(preload)
        self.limits = limits
        self.environ = dict(child_environ(os.environ) if environ is None else environ)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._closed = False
        self._queue: FairQueue[Request] = FairQueue(job_weights)
        self._workers: list[Worker] = []
        self._ids = itertools.count()
        self._changed = asyncio.Event()
        self._wids = itertools.count()
        self.meters = PoolMeters(window_s)
        self._start_failures = 0  # consecutive workers that died before Ready
        self._last_start_error = ""

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, *, ready_timeout: float = 60.0) -> None:
        """Spawn `min_workers` and wait until they are ready; `RewardError` (pool closed) if they cannot start."""
        if self._running or self._closed:
            raise RewardError("reward pool: start() called twice, or after close()")
        self._loop = asyncio.get_running_loop()
        self._running, self._started_at = True, time.monotonic()
        self._ensure_min()
        try:
            stats = await self.wait_until(lambda s: s.starting_workers == 0, timeout=ready_timeout)
        except DeadlineExceeded:
            await self.close()
            raise
        if stats.live_workers < self.min_workers:
            await self.close()
            raise RewardError(f"reward pool: workers failed to start: {self._last_start_error}")
        log.info("reward_pool_started", min_workers=self.min_workers, max_workers=self.max_workers)

    async def close(self, *, grace_s: float = 2.0) -> None:
        """Fail waiting and running requests; stop idle workers, kill busy ones, kill any left after `grace_s`."""
        if self._closed:
            return
        self._running = False
        self._closed = True
        if self._loop is None:  # never started: nothing to stop
            return
        for _, req in self._queue.drain():
            self._fail(req, RewardError("reward pool closed before the request ran"))
        for w in self._workers:
            if w.job is not None:  # the job stays on the worker until its exit closes the busy interval
                self._fail(w.job, RewardError(f"reward pool closed while {w.job.name!r} was running"))
        await stop_workers(list(self._workers), grace_s, self._loop)
        for w in list(self._workers):  # a worker that survived SIGKILL: release our side anyway
            w.release(self._loop)
            self._workers.remove(w)
        self._notify()
        log.info(
            "reward_pool_closed", served=self.meters.served, failed=self.meters.failed, crashed=self.meters.crashed
        )

    async def __aenter__(self) -> RewardPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- requests --------------------------------------------------------------------------

    async def score(self, fn_name: str, item: ScoreInput, *, timeout: float, job: str = "") -> ScoreOutput:
        """Score `item` with the reward registered as `fn_name` within `timeout` seconds, for `job`.

        Raises `RewardError` (unknown function, bad input, function failed, worker crashed, pool
        closed) or `DeadlineExceeded` (deadline passed: dropped if still queued, result discarded
        if running).
        """
        if not self._running or self._loop is None:
            raise RewardError("reward pool is " + ("closed" if self._closed else "not started"))
        fn = get_reward(fn_name)  # UnknownReward is a RewardError: fails before queueing
        req_id = next(self._ids)
        framed = frame(request_encoder.encode(Job(req_id, fn_name, reference(fn), item)))
        req = Request(req_id, fn_name, framed, self._loop.create_future(), job, time.monotonic())
        self._arrivals.record(req.queued_at)
        self._queue.push(job, req)
        try:
            self._pump()
            async with asyncio.timeout(timeout):
                return await req.future
        except TimeoutError:
            where = "was running" if req.started else "was still queued"
            self.meters.count(job, served=False)
            self.meters.timed_out += 1
            raise DeadlineExceeded(f"reward {fn_name!r} did not finish within {timeout:g} s ({where})") from None
        finally:
            if not req.started and self._queue.remove(job, req):
                self._notify()

    def stats(self) -> PoolStats:
        """A snapshot of workers, queue, counters, cold starts and utilization."""
        return self.meters.snapshot(self._workers, queue=self._queue)

    async def wait_until(self, predicate: Callable[[PoolStats], bool], *, timeout: float) -> PoolStats:
        """Wait until `predicate(stats())` holds (checked on every change); `DeadlineExceeded` past `timeout`."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate(stats := self.stats()):
                    await self._changed.wait()
                return stats
        except TimeoutError:
            raise DeadlineExceeded(f"reward pool did not reach the awaited state within {timeout:g} s") from None

    # -- dispatch and scaling --------------------------------------------------------------

    def _live(self) -> int:
        return sum(w.state in _LIVE for w in self._workers)

    def _pump(self) -> None:
        """Hand queued requests to idle workers, then grow the pool if the queue is still too deep."""
        assert self._loop is not None
        while self._queue and self._running:
            idle = [w for w in self._workers if w.state is State.IDLE]
            if not idle:
                break
            w = max(idle, key=lambda w: w.idle_since)  # most recently used: lets the others retire
            job, req = self._queue.pop()
            now = time.monotonic()
            if not w.assign(req, now, self._loop):
                self._queue.push_front(job, req)  # never started; its exit will report the dead worker
            else:
                self.meters.started(job, now - req.queued_at)
        while self._running and len(self._queue) > self.scale_up_queue_per_worker * self._live():
            if self._live() >= self.max_workers or not self._spawn():
                break
        self._notify()

    def _ensure_min(self) -> None:
        while self._running and self._live() < self.min_workers and self._start_failures < 2 and self._spawn():
            pass

    def _spawn(self) -> bool:
        assert self._loop is not None
        try:
            w = Worker.spawn(
                next(self._wids),
                self._loop,
                preload=self.preload,
                limits=self.limits,
                environ=self.environ,
                on_readable=self._on_readable,
                on_exit=self._on_exit,
                launch=self.launch,
            )
        except OSError as e:  # out of processes or descriptors: the queue waits, or fails if nobody is left
            log.error("reward_worker_spawn_failed", error=str(e))
            self._last_start_error = f"could not spawn a worker: {e}"
            return False
        self._workers.append(w)
        self.meters.peak = max(self.meters.peak, self._live())
        log.info("reward_worker_spawned", worker=w.wid, pid=w.pid, live=self._live())
        return True

    def _set_idle(self, w: Worker) -> None:
        assert self._loop is not None
        w.set_idle(self._loop.call_later(self._look_after_s(0.0), self._on_idle_timeout, w))
        if self.release == "by-gap" and not self._queue:  # queued work goes to it next (`_pump`)
            self._on_idle_timeout(w)

    def _look_after_s(self, idle_s: float) -> float:
        """When to look at an idle worker again: at its idle timeout, or with `by-gap` after a cold start."""
        left = self.idle_timeout_s - idle_s
        if self.release == "by-gap":
            cold = self.meters.cold.snapshot()
            left = min(left, cold.mean_s if cold.count else left)
        return max(0.0, left)

    def _on_idle_timeout(self, w: Worker) -> None:
        assert self._loop is not None
        w.cancel_idle_timer()
        if w.state is not State.IDLE or not self._running or self._live() <= self.min_workers:
            return
        now = time.monotonic()
        idle_s = now - w.idle_since
        if self.release == "idle" or idle_s >= self.idle_timeout_s or self._spare(now):
            log.info("reward_worker_retired", worker=w.wid, idle_s=round(idle_s, 3), release=self.release)
            w.stop(self._loop)
            self._notify()
        else:
            w.idle_timer = self._loop.call_later(self._look_after_s(idle_s), self._on_idle_timeout, w)

    def _spare(self, now: float) -> bool:
        """`release="by-gap"` (`rollart.rewards.release`), the cold start as measured here."""
        cold = self.meters.cold.snapshot()
        if not cold.count:
            return False
        window = min(self.meters.busy.window_s, now - self._started_at)
        busy = [w.busy_since for w in self._workers if w.state is State.BUSY]
        load = self.meters.busy.in_window(busy, now) / window if window >= cold.mean_s and window > 0 else None
        idle = sum(w.state is State.IDLE for w in self._workers)
        return spare(self._arrivals, now, idle=idle, live=self._live(), load=load, cold_start_s=cold.mean_s)

    # -- worker events (loop callbacks) ----------------------------------------------------

    def _on_readable(self, w: Worker) -> None:
        assert self._loop is not None
        data = w.process.receive()
        if data is None:
            return
        if not data:  # EOF: the worker is exiting, and its exit callback says how
            w.process.stop_reading(self._loop)
            return
        self._take(w, data)
        self._pump()

    def _take(self, w: Worker, data: bytes) -> None:
        replies, broken = w.feed(data)
        for reply in replies:
            if w.kill_cause is not None:
                return
            self._on_reply(w, reply)
        if broken is not None:
            self._break(w, broken)

    def _on_reply(self, w: Worker, reply: Reply) -> None:
        match reply:
            case Ready(pid=pid) if not w.ready:
                w.ready = True
                cold = time.monotonic() - w.spawned_at
                self.meters.cold.add(cold)
                self._start_failures = 0
                log.info("reward_worker_ready", worker=w.wid, pid=pid, cold_start_s=round(cold, 3))
                if w.state is State.STARTING:
                    self._set_idle(w)
            case StartFailed(reason=reason) if not w.ready:
                w.start_error = reason
            case Done() | Failed():
                self._on_result(w, reply)
            case _:
                self._break(w, f"it sent a {tag_of(reply)!r} reply after it was ready")

    def _on_result(self, w: Worker, msg: Done | Failed) -> None:
        req = w.job
        if req is None or req.req_id != msg.req_id:
            running = f"while running job {req.req_id}" if req is not None else "with no job running"
            self._break(w, f"it answered job {msg.req_id} {running}")
            return
        w.job = None
        w.cpu_s = msg.cpu_s
        self._ran(w, req)
        if w.state is State.BUSY:
            if w.cpu_s >= RETIRE_AT * self.limits.cpu_time_s:
                self._retire_spent(w)
            else:
                self._set_idle(w)
        if req.future.done():  # the caller timed out or went away: nobody to tell
            return
        if isinstance(msg, Done):
            req.future.set_result(msg.output)
            self.meters.count(req.owner, served=True)
        else:
            self._fail(req, RewardError(msg.message))

    def _retire_spent(self, w: Worker) -> None:
        """Replace a worker that used most of its CPU seconds, before the kernel's limit ends it mid-job."""
        assert self._loop is not None
        log.info("reward_worker_retired", worker=w.wid, cpu_s=round(w.cpu_s, 2), cpu_time_s=self.limits.cpu_time_s)
        w.stop(self._loop)
        self._ensure_min()

    def _break(self, w: Worker, why: str) -> None:
        """`w` sent what no worker should: fail its job, naming it and why, and kill it."""
        assert self._loop is not None
        if w.kill_cause is not None:
            return
        log.warning("reward_worker_broken", worker=w.wid, pid=w.pid, why=why)
        job = w.job
        w.kill(why, self._loop)
        if job is not None:
            w.job = None
            self._ran(w, job)
            self._fail(job, RewardError(f"reward {job.name!r} failed: its {w.describe()} was killed: {why}"))

    def _on_exit(self, w: Worker) -> None:
        assert self._loop is not None
        while w.kill_cause is None and (data := w.process.receive()):  # a result sent just before dying counts
            self._take(w, data)
        code = w.release(self._loop)
        self._workers.remove(w)
        self.meters.live.close(w.spawned_at, time.monotonic())
        w.exited.set_result(None)
        ended = f"exit code {code}" if code is not None and code >= 0 else exit_cause(code, self.limits)
        if w.state is not State.RETIRING:
            self.meters.crashed += 1
            if w.state is State.STARTING:
                self._start_failures += 1
                self._last_start_error = w.start_error or f"worker {ended} before ready"
            log.warning("reward_worker_crashed", worker=w.wid, exit_code=code, state=w.state.name, cause=w.kill_cause)
        if w.job is not None:
            job, w.job = w.job, None
            self._ran(w, job)
            self._fail(job, RewardError(f"reward worker crashed ({ended}) while running {job.name!r}"))
        if self._start_failures >= 2 and not any(x.state in (State.IDLE, State.BUSY) for x in self._workers):
            reason = f"reward workers fail to start: {self._last_start_error}"
            for _, req in self._queue.drain():  # each new request may still try once more
                self._fail(req, RewardError(reason))
        self._ensure_min()
        self._pump()

    def _ran(self, w: Worker, req: Request) -> None:
        """`req` has left worker `w` (done, failed or killed): its busy time counts, for it and its job."""
        now = time.monotonic()
        self.meters.busy.close(w.busy_since, now)
        self.meters.ran(req.owner, now - w.busy_since)
        self._queue.charge(req.owner, req, now - w.busy_since)

    def _fail(self, req: Request, error: RewardError) -> None:
        if not req.future.done():
            req.future.set_exception(error)
            self.meters.count(req.owner, served=False)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
