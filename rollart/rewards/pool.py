"""`RewardPool`: Reward-as-a-Service on one host, an elastic pool of reward worker processes.

Requests wait in one FIFO queue and go to an idle worker (the most recently used first, so the
others stay idle long enough to retire). The pool grows by one worker while the queue is deeper
than `scale_up_queue_per_worker` x live workers, up to `max_workers`; a worker idle for
`idle_timeout_s` retires unless that would leave fewer than `min_workers`. With
`min_workers=0` an idle pool costs nothing and the next request pays a cold start, which is
measured (spawn to the worker's `Ready`).

Everything is event driven on the caller's loop, with no thread and no polling: the loop watches
each worker's pipe (`add_reader`) for results and its process sentinel for its exit; idle
retirement is a `call_later` timer per idle worker. `close()` removes all of them.

    async with RewardPool(min_workers=0, max_workers=4) as pool:
        out = await pool.score("exact-answer", ScoreInput(task="math", prompt=p, response=r, answer="42"),
                               timeout=30.0)
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.context import SpawnContext
from typing import cast

import msgspec
import structlog

from rollart.errors import ConfigError, DeadlineExceeded
from rollart.rewards.base import RewardError, ScoreInput, ScoreOutput, get_reward
from rollart.rewards.handles import Request, Worker, stop_workers
from rollart.rewards.stats import PoolMeters, PoolStats, State
from rollart.rewards.worker import Done, Failed, Ready, StartFailed

log = structlog.get_logger("rollart.rewards.pool")

_LIVE = (State.STARTING, State.IDLE, State.BUSY)


class RewardPool:
    """An elastic pool of reward worker processes, driven from one asyncio loop."""

    def __init__(
        self,
        min_workers: int = 0,
        max_workers: int = 4,
        scale_up_queue_per_worker: int = 2,
        idle_timeout_s: float = 5.0,
        mp_context: str = "spawn",
        *,
        preload: Sequence[str] = (),
        window_s: float = 30.0,
    ) -> None:
        """`preload`: modules each worker imports before it reports ready (e.g. "torch"), so the
        import is part of the measured cold start instead of the first request's latency."""
        if not 0 <= min_workers <= max_workers or max_workers < 1:
            raise ConfigError(
                f"reward pool: need 0 <= min_workers <= max_workers >= 1, got {min_workers}, {max_workers}"
            )
        if scale_up_queue_per_worker < 1 or idle_timeout_s <= 0:
            raise ConfigError("reward pool: scale_up_queue_per_worker must be >= 1 and idle_timeout_s > 0")
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.scale_up_queue_per_worker = scale_up_queue_per_worker
        self.idle_timeout_s = idle_timeout_s
        self.preload = tuple(preload)
        # Every start method's context has the same Process/Pipe API; typeshed only types them one by one.
        self._ctx = cast(SpawnContext, multiprocessing.get_context(mp_context))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._closed = False
        self._queue: deque[Request] = deque()
        self._workers: list[Worker] = []
        self._ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ScoreOutput)
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
        self._running = True
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
        """Fail waiting and running requests; stop idle workers, terminate busy ones, kill any left after `grace_s`."""
        if self._closed:
            return
        self._running = False
        self._closed = True
        while self._queue:
            self._fail(self._queue.popleft(), RewardError("reward pool closed before the request ran"))
        for w in self._workers:
            if w.job is not None:  # the job stays on the worker until its exit closes the busy interval
                self._fail(w.job, RewardError(f"reward pool closed while {w.job.name!r} was running"))
        await stop_workers(list(self._workers), grace_s)
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

    async def score(self, fn_name: str, item: ScoreInput, *, timeout: float) -> ScoreOutput:
        """Score `item` with the reward registered as `fn_name` within `timeout` seconds.

        Raises `RewardError` (unknown function, bad input, function failed, worker crashed, pool
        closed) or `DeadlineExceeded` (deadline passed: dropped if still queued, result discarded
        if running).
        """
        if not self._running or self._loop is None:
            raise RewardError("reward pool is " + ("closed" if self._closed else "not started"))
        fn = get_reward(fn_name)  # UnknownReward is a RewardError: fails before queueing
        req = Request(
            next(self._ids), fn_name, pickle.dumps(fn), self._encoder.encode(item), self._loop.create_future()
        )
        self._queue.append(req)
        try:
            self._pump()
            async with asyncio.timeout(timeout):
                return await req.future
        except TimeoutError:
            where = "was running" if req.started else "was still queued"
            self.meters.failed += 1
            self.meters.timed_out += 1
            raise DeadlineExceeded(f"reward {fn_name!r} did not finish within {timeout:g} s ({where})") from None
        finally:
            if not req.started and req in self._queue:
                self._queue.remove(req)
                self._notify()

    def stats(self) -> PoolStats:
        """A snapshot of workers, queue, counters, cold starts and utilization."""
        return self.meters.snapshot(self._workers, queue_depth=len(self._queue))

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
        while self._queue and self._running:
            idle = [w for w in self._workers if w.state is State.IDLE]
            if not idle:
                break
            w = max(idle, key=lambda w: w.idle_since)  # most recently used: lets the others retire
            req = self._queue.popleft()
            if not w.assign(req, time.monotonic()):
                self._queue.appendleft(req)  # never started; the sentinel will report the dead worker
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
            w = Worker.spawn(self._ctx, next(self._wids), self.preload, self._loop)
        except OSError as e:  # out of processes or descriptors: the queue waits, or fails if nobody is left
            log.error("reward_worker_spawn_failed", error=str(e))
            self._last_start_error = f"could not spawn a worker: {e}"
            return False
        self._loop.add_reader(w.conn.fileno(), self._on_message, w)
        self._loop.add_reader(w.proc.sentinel, self._on_exit, w)
        self._workers.append(w)
        self.meters.peak = max(self.meters.peak, self._live())
        log.info("reward_worker_spawned", worker=w.wid, pid=w.proc.pid, live=self._live())
        return True

    def _set_idle(self, w: Worker) -> None:
        assert self._loop is not None
        w.set_idle(self._loop.call_later(self.idle_timeout_s, self._on_idle_timeout, w))

    def _on_idle_timeout(self, w: Worker) -> None:
        w.idle_timer = None
        if w.state is State.IDLE and self._running and self._live() > self.min_workers:
            log.info("reward_worker_retired", worker=w.wid, idle_s=self.idle_timeout_s)
            w.stop()
            self._notify()

    # -- worker events (loop callbacks) ----------------------------------------------------

    def _on_message(self, w: Worker) -> None:
        assert self._loop is not None
        msg = w.recv(self._loop)
        match msg:
            case None:
                return
            case Ready(pid=pid):
                cold = time.monotonic() - w.spawned_at
                self.meters.cold.add(cold)
                self._start_failures = 0
                log.info("reward_worker_ready", worker=w.wid, pid=pid, cold_start_s=round(cold, 3))
                if w.state is State.STARTING:
                    self._set_idle(w)
            case StartFailed(reason=reason):
                w.start_error = reason
            case Done() | Failed():
                self._on_result(w, msg)
        self._pump()

    def _on_result(self, w: Worker, msg: Done | Failed) -> None:
        req = w.job
        if req is None or req.req_id != msg.req_id:
            log.warning("reward_result_unexpected", worker=w.wid, req_id=msg.req_id)
            return
        w.job = None
        self.meters.busy.close(w.busy_since, time.monotonic())
        if w.state is State.BUSY:
            self._set_idle(w)
        if req.future.done():  # the caller timed out or went away: nobody to tell
            return
        if isinstance(msg, Done):
            try:
                req.future.set_result(self._decoder.decode(msg.output))
                self.meters.served += 1
            except msgspec.DecodeError as e:
                self._fail(req, RewardError(f"reward {req.name!r}: undecodable result from worker: {e}"))
        else:
            self._fail(req, RewardError(msg.message))

    def _on_exit(self, w: Worker) -> None:
        assert self._loop is not None
        while (msg := w.recv(self._loop)) is not None:  # a result sent just before dying still counts
            if isinstance(msg, Done | Failed):
                self._on_result(w, msg)
            elif isinstance(msg, StartFailed):
                w.start_error = msg.reason
        code = w.release(self._loop)
        self._workers.remove(w)
        self.meters.live.close(w.spawned_at, time.monotonic())
        w.exited.set_result(None)
        if w.state is not State.RETIRING:
            self.meters.crashed += 1
            if w.state is State.STARTING:
                self._start_failures += 1
                self._last_start_error = w.start_error or f"worker exited with code {code} before ready"
            log.warning("reward_worker_crashed", worker=w.wid, exit_code=code, state=w.state.name)
        if w.job is not None:
            self.meters.busy.close(w.busy_since, time.monotonic())
            job, w.job = w.job, None
            self._fail(job, RewardError(f"reward worker crashed (exit code {code}) while running {job.name!r}"))
        if self._start_failures >= 2 and not any(x.state in (State.IDLE, State.BUSY) for x in self._workers):
            reason = f"reward workers fail to start: {self._last_start_error}"
            while self._queue:  # each new request may still try once more
                self._fail(self._queue.popleft(), RewardError(reason))
        self._ensure_min()
        self._pump()

    def _fail(self, req: Request, error: RewardError) -> None:
        if not req.future.done():
            req.future.set_exception(error)
            self.meters.failed += 1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
