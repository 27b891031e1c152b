"""The pool's side of one env worker: its process (`rollart.workers.spawn`), its envs and its calls in flight.

Small and synchronous on purpose: `EnvWorkerPool` decides; these keep state, start the worker and
read its replies. The socket calls (`WorkerProcess`) never block the loop and may fail at any
moment (a dying worker breaks its socket).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollart.envexec.wire import (
    MAX_REPLY_BYTES,
    CallReply,
    Closed,
    Failed,
    Made,
    Ready,
    Reply,
    ResetDone,
    StepDone,
    WorkerReplyError,
    reply_decoder,
    tag_of,
)
from rollart.envexec.worker import WorkerConfig
from rollart.workers.framing import decode_stream
from rollart.workers.limits import WorkerLimits
from rollart.workers.spawn import NO_SANDBOX, Launch, WorkerProcess, spawn

SHOWN_CHARS = 200
"""How much of a wrong reply an error message shows."""


class WorkerState(enum.Enum):
    STARTING = enum.auto()  # importing the env modules
    READY = enum.auto()  # takes new envs
    RETIRING = enum.auto()  # used most of its CPU limit: no new envs, stopped once it hosts none
    DEAD = enum.auto()


def consume(future: asyncio.Future[Any]) -> None:
    """Retrieve a future's exception (done callback): a call whose caller went away fails unawaited."""
    if not future.cancelled():
        future.exception()


@dataclass(eq=False)
class PendingCall:
    """One call sent to a worker and not answered yet."""

    call_id: int
    worker: EnvWorker
    env_id: int
    env_name: str
    op: str
    answer: type[Made | ResetDone | StepDone | Closed]
    """The reply that answers it (besides `Failed`); any other fails the call."""
    timeout_s: float
    future: asyncio.Future[Any]
    """Gets `answer` or `Failed` (typed where `EnvWorkerPool.submit` hands it out)."""
    timer: asyncio.TimerHandle | None = None
    timed_out: bool = False
    """Its deadline passed and its worker was killed for it."""
    failed_by: str | None = None
    """The tag of the wrong reply its worker answered it with, if it did."""

    def failure(self) -> str:
        """What the call's `EnvFailure` says once its worker is dead."""
        worker = self.worker
        if self.timed_out:
            return (
                f"env {self.env_name!r}: {self.op}() timed out after {self.timeout_s:g} s; "
                f"its {worker.describe()} was killed"
            )
        return f"env {self.env_name!r}: {self.op}() failed: its {worker.describe()} died: {worker.death}"

    def wrong_reply(self, reply: Reply) -> WorkerReplyError:
        """The error of this call when its worker answered with `reply`, which is not its `answer`."""
        shown = repr(reply)
        if len(shown) > SHOWN_CHARS:  # a hostile worker may send megabytes
            shown = shown[:SHOWN_CHARS] + "..."
        return WorkerReplyError(
            f"env {self.env_name!r}: {self.op}() failed: its {self.worker.describe()} answered with a "
            f"{tag_of(reply)!r} reply where {tag_of(self.answer)!r} or 'failed' was due: {shown}"
        )


@dataclass(eq=False)
class EnvWorker:
    """One worker process as the pool sees it."""

    wid: int
    process: WorkerProcess
    ready: asyncio.Future[Ready]
    exited: asyncio.Future[None]
    started_at: float = field(default_factory=time.monotonic)
    state: WorkerState = WorkerState.STARTING
    envs: set[int] = field(default_factory=set)
    """Ids of the envs it hosts (from `make` until `close` answers)."""
    calls: dict[int, PendingCall] = field(default_factory=dict)
    cpu_s: float = 0.0
    """Its CPU seconds, as its latest reply said."""
    kill_cause: str | None = None
    """Why the pool killed it, once it did."""
    death: str | None = None
    """How it ended, once it did."""
    start_error: str = ""

    @classmethod
    def start(
        cls,
        wid: int,
        loop: asyncio.AbstractEventLoop,
        *,
        env_modules: list[str],
        limits: WorkerLimits,
        environ: Mapping[str, str],
        on_readable: Callable[[EnvWorker], None],
        on_exit: Callable[[EnvWorker], None],
        launch: Launch = NO_SANDBOX,
    ) -> EnvWorker:
        """Start worker `wid` (`OSError` if the OS refuses); `on_readable(worker)` runs when its socket
        has bytes (or EOF), `on_exit(worker)` once its process has exited. Call from the loop's thread."""
        process = spawn(
            "rollart.envexec.worker",
            lambda fd, parent: WorkerConfig(fd=fd, parent_pid=parent, limits=limits, env_modules=env_modules),
            environ=environ,
            max_frame_bytes=MAX_REPLY_BYTES,
            launch=launch,
        )
        worker = cls(wid, process, loop.create_future(), loop.create_future())
        worker.ready.add_done_callback(consume)
        process.watch(loop, lambda: on_readable(worker), lambda: on_exit(worker))
        return worker

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def ended(self) -> str | None:
        """How it ended or why it is being killed; None while it serves."""
        return self.death or self.kill_cause

    @property
    def takes_envs(self) -> bool:
        return self.state in (WorkerState.STARTING, WorkerState.READY)

    def describe(self) -> str:
        return f"env worker {self.wid} (pid {self.pid})"

    def send(self, data: bytes, loop: asyncio.AbstractEventLoop) -> None:
        """Write `data` without blocking (`WorkerProcess.send`). A broken socket is ignored: the worker
        is gone, and its exit is reported by its process."""
        if self.kill_cause is None and self.state is not WorkerState.DEAD:
            self.process.send(data, loop)

    def feed(self, data: bytes) -> tuple[list[Reply], str | None]:
        """The whole replies in what arrived so far, and what is wrong with the stream if something is
        (a frame over `MAX_REPLY_BYTES`, bytes that are not a reply): a worker that sends that is broken."""
        return decode_stream(self.process.reader, data, reply_decoder)

    def settle(self, reply: CallReply) -> PendingCall | None:
        """Complete the call `reply` answers: its result, or `WorkerReplyError` for a reply of another
        kind than its `answer` (the call and its env fail; the worker serves on). The call, or None
        for a reply to no call sent (a confused worker; nothing waits for it)."""
        self.cpu_s = reply.cpu_s
        call = self.calls.pop(reply.call, None)
        if call is None:
            return None
        if call.timer is not None:
            call.timer.cancel()
        if call.op == "close" or (call.op == "make" and not isinstance(reply, Made)):
            self.envs.discard(call.env_id)
        if not isinstance(reply, call.answer | Failed):
            call.failed_by = tag_of(reply)
        if not call.future.done():
            if call.failed_by is None:
                call.future.set_result(reply)
            else:
                call.future.set_exception(call.wrong_reply(reply))
        return call
