"""The pool's side of things: a queued request, and a worker process with its socket and state.

Small and synchronous on purpose: `RewardPool` decides; these keep state, start a worker
(`rollart.workers.spawn`), write its jobs and read its replies. The socket calls never block the
loop and may fail at any moment (a dying worker breaks its socket).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from rollart.rewards.base import ScoreOutput
from rollart.rewards.stats import State
from rollart.rewards.wire import MAX_REPLY_BYTES, Reply, Stop, reply_decoder, request_encoder
from rollart.rewards.worker import WorkerConfig
from rollart.workers.framing import decode_stream, frame
from rollart.workers.limits import WorkerLimits
from rollart.workers.spawn import NO_SANDBOX, Launch, WorkerProcess, spawn

log = structlog.get_logger("rollart.rewards.pool")


@dataclass(eq=False)
class Request:
    """One `score` call, from the queue to its worker."""

    req_id: int
    name: str
    job: bytes
    """Its `Job`, framed for the socket."""
    future: asyncio.Future[ScoreOutput]
    owner: str = ""
    """The job (training run) that asked, for fair sharing (`rollart.rewards.fair`)."""
    queued_at: float = 0.0
    """`time.monotonic()` when it was queued."""
    started: bool = False


@dataclass(eq=False)
class Worker:
    """A worker process, the pool's end of its socket, and what it is doing."""

    wid: int
    process: WorkerProcess
    spawned_at: float
    exited: asyncio.Future[None]
    state: State = State.STARTING
    job: Request | None = None
    busy_since: float = 0.0
    idle_since: float = 0.0
    idle_timer: asyncio.TimerHandle | None = None
    ready: bool = False
    """It said `Ready` (once)."""
    start_error: str = ""
    cpu_s: float = 0.0
    """Its CPU seconds, as its latest reply said."""
    kill_cause: str | None = None
    """Why the pool killed it as broken, once it did."""

    @classmethod
    def spawn(
        cls,
        wid: int,
        loop: asyncio.AbstractEventLoop,
        *,
        preload: Sequence[str],
        limits: WorkerLimits,
        environ: Mapping[str, str],
        on_readable: Callable[[Worker], None],
        on_exit: Callable[[Worker], None],
        launch: Launch = NO_SANDBOX,
    ) -> Worker:
        """Start a worker process (`OSError` if the OS refuses); `on_readable(worker)` runs when its
        socket has bytes (or EOF), `on_exit(worker)` once it has exited. Call from the loop's thread."""
        spawned_at = time.monotonic()
        process = spawn(
            "rollart.rewards.worker",
            lambda fd, parent: WorkerConfig(fd=fd, parent_pid=parent, limits=limits, preload=list(preload)),
            environ=environ,
            max_frame_bytes=MAX_REPLY_BYTES,
            launch=launch,
        )
        worker = cls(wid, process, spawned_at, loop.create_future())
        process.watch(loop, lambda: on_readable(worker), lambda: on_exit(worker))
        return worker

    @property
    def pid(self) -> int:
        return self.process.pid

    def describe(self) -> str:
        return f"reward worker {self.wid} (pid {self.pid})"

    def assign(self, req: Request, now: float, loop: asyncio.AbstractEventLoop) -> bool:
        """Send `req` to this (idle) worker; False, and the worker marked broken, if its socket failed."""
        self.cancel_idle_timer()
        if not self.process.send(req.job, loop):
            self.state = State.BROKEN
            return False
        self.state = State.BUSY
        self.job = req
        self.busy_since = now
        req.started = True
        return True

    def feed(self, data: bytes) -> tuple[list[Reply], str | None]:
        """The whole replies in what arrived so far, and what is wrong with the stream if something is
        (a frame over `MAX_REPLY_BYTES`, bytes that are not a reply): a worker that sends that is broken."""
        return decode_stream(self.process.reader, data, reply_decoder)

    def set_idle(self, retire_timer: asyncio.TimerHandle) -> None:
        """Ready for a job; `retire_timer` fires if none comes in time."""
        self.state = State.IDLE
        self.idle_since = time.monotonic()
        self.idle_timer = retire_timer

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Ask a worker without a job to finish; kill one that is starting or running a job (no point
        waiting for it)."""
        self.cancel_idle_timer()
        if self.state is State.BROKEN:  # killed already
            return
        between_jobs = self.job is None and self.state in (State.IDLE, State.BUSY)
        if not between_jobs or not self.process.send(frame(request_encoder.encode(Stop())), loop):
            self.process.proc.kill()
        self.state = State.RETIRING

    def kill(self, cause: str, loop: asyncio.AbstractEventLoop) -> None:
        """End a broken worker: nothing more it sends is read; its exit is reported as a crash."""
        self.kill_cause = cause
        self.state = State.BROKEN
        self.cancel_idle_timer()
        self.process.stop_reading(loop)
        self.process.proc.kill()

    def cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def release(self, loop: asyncio.AbstractEventLoop) -> int | None:
        """Stop watching, close the socket, reap the process; its exit code (None if it still runs)."""
        self.cancel_idle_timer()
        return self.process.release(loop)


async def stop_workers(workers: list[Worker], grace_s: float, loop: asyncio.AbstractEventLoop) -> None:
    """Stop every worker, SIGKILL those still running after `grace_s`, and wait (as long again) for their exits.

    The exits are reported by the pool's exit callbacks, which run while this waits.
    """
    for w in workers:
        w.stop(loop)
    pending = {w.exited for w in workers}
    if pending:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for w in workers:
        if w.exited in pending:
            log.warning("reward_worker_killed", worker=w.wid, pid=w.pid)
            w.process.proc.kill()
    if pending:
        await asyncio.wait(pending, timeout=grace_s)
