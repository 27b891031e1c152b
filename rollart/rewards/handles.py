"""The pool's side of things: a queued request, and a worker process with its pipe and state.

Small and synchronous on purpose: `RewardPool` decides, these only keep state and do the pipe
and process calls that may fail (a dying worker breaks its pipe at any moment).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

import structlog

from rollart.rewards.base import ScoreOutput
from rollart.rewards.stats import State
from rollart.rewards.worker import Job, WorkerMessage, worker_main

log = structlog.get_logger("rollart.rewards.pool")


@dataclass(eq=False)
class Request:
    """One `score` call, from the queue to its worker."""

    req_id: int
    name: str
    fn_ref: bytes
    item: bytes
    future: asyncio.Future[ScoreOutput]
    started: bool = False


@dataclass(eq=False)
class Worker:
    """A worker process, the pool's end of its pipe, and what it is doing."""

    wid: int
    proc: BaseProcess
    conn: Connection
    spawned_at: float
    exited: asyncio.Future[None]
    state: State = State.STARTING
    job: Request | None = None
    busy_since: float = 0.0
    idle_since: float = 0.0
    idle_timer: asyncio.TimerHandle | None = None
    start_error: str = ""
    _reading: bool = field(default=True, repr=False)

    @classmethod
    def spawn(cls, ctx: SpawnContext, wid: int, preload: tuple[str, ...], loop: asyncio.AbstractEventLoop) -> Worker:
        """Start a worker process (`OSError` if the OS refuses); the loop still has to watch it."""
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_main, args=(child, preload), name=f"rollart-reward-{wid}")
        proc.daemon = True  # should the parent die without close(), multiprocessing still stops it
        spawned_at = time.monotonic()
        try:
            proc.start()  # fork+exec and a small pickle through a pipe: ~15 ms, not worth a thread
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()  # only the worker holds its end now, so its death reads as EOF here
        return cls(wid, proc, parent, spawned_at, loop.create_future())

    def assign(self, req: Request, now: float) -> bool:
        """Send `req` to this (idle) worker; False, and the worker marked broken, if the pipe failed."""
        self.cancel_idle_timer()
        if not self.send(Job(req.req_id, req.name, req.fn_ref, req.item)):
            self.state = State.BROKEN
            return False
        self.state = State.BUSY
        self.job = req
        self.busy_since = now
        req.started = True
        return True

    def send(self, msg: Job | None) -> bool:
        """Write one message; the worker is idle in `recv`, so even a long response is taken as fast as written."""
        try:
            self.conn.send(msg)
        except (OSError, ValueError):  # broken pipe, or our end already closed
            return False
        return True

    def recv(self, loop: asyncio.AbstractEventLoop) -> WorkerMessage | None:
        """The next message if one is waiting, else None; at EOF, stop watching the pipe.

        The loop calls this when the pipe is readable. A message is written whole by the worker
        in one go and is small, so `recv` does not wait on a slow writer.
        """
        if not self._reading:
            return None
        try:
            if not self.conn.poll():
                return None
            msg: WorkerMessage = self.conn.recv()
        except (EOFError, OSError):  # the worker is gone; its sentinel reports how
            self._stop_reading(loop)
            return None
        return msg

    def set_idle(self, retire_timer: asyncio.TimerHandle) -> None:
        """Ready for a job; `retire_timer` fires if none comes in time."""
        self.state = State.IDLE
        self.idle_since = time.monotonic()
        self.idle_timer = retire_timer

    def stop(self) -> None:
        """Ask an idle worker to finish; terminate one that is starting or busy (no point waiting for it)."""
        self.cancel_idle_timer()
        if self.state is not State.IDLE or not self.send(None):
            self.proc.terminate()
        self.state = State.RETIRING

    def cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def release(self, loop: asyncio.AbstractEventLoop | None) -> int | None:
        """Stop watching, close the pipe, reap the process; its exit code (None if it still runs)."""
        self.cancel_idle_timer()
        if loop is not None:
            self._stop_reading(loop)
            loop.remove_reader(self.proc.sentinel)
        self.conn.close()
        # Called once the sentinel is readable, i.e. the process is exiting: the join returns
        # at once. The timeout only bounds the case of a process that survived SIGKILL.
        self.proc.join(timeout=1.0)
        code = self.proc.exitcode
        if code is not None:
            self.proc.close()
        return code

    def _stop_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._reading:
            self._reading = False
            loop.remove_reader(self.conn.fileno())


async def stop_workers(workers: list[Worker], grace_s: float) -> None:
    """Stop every worker, SIGKILL those still running after `grace_s`, and wait (as long again) for their exits.

    The exits are reported by the pool's sentinel callbacks, which run while this waits.
    """
    for w in workers:
        w.stop()
    pending = {w.exited for w in workers}
    if pending:
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for w in workers:
        if w.exited in pending:
            log.warning("reward_worker_killed", worker=w.wid, pid=w.proc.pid)
            w.proc.kill()
    if pending:
        await asyncio.wait(pending, timeout=grace_s)
