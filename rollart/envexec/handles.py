"""The pool's side of one env worker: its process, its socket, its envs and its calls in flight.

Small and synchronous on purpose: `EnvWorkerPool` decides; these keep state and do the socket
calls, which never block the loop (writes the socket cannot take now wait in `outbox` until the
loop says it is writable) and may fail at any moment (a dying worker breaks its socket).
"""

from __future__ import annotations

import asyncio
import enum
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

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
from rollart.protocol.framing import HEADER_BYTES, frame_length

RECV_BYTES = 1 << 18
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
    proc: subprocess.Popen[bytes]
    sock: socket.socket
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
    pidfd: int | None = None
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)

    @property
    def pid(self) -> int:
        return self.proc.pid

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
        """Write `data` without blocking; what the socket does not take now is sent when it is writable.
        A broken socket is ignored: the worker is gone, and its exit is reported by its process."""
        if self.kill_cause is not None or self.state is WorkerState.DEAD:
            return
        if not self.outbox:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return
            if sent == len(data):
                return
            data = data[sent:]
            loop.add_writer(self.sock.fileno(), self.on_writable, loop)
        self.outbox += data

    def on_writable(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            sent = self.sock.send(self.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(self.outbox)
        del self.outbox[:sent]
        if not self.outbox:
            loop.remove_writer(self.sock.fileno())

    def receive(self) -> bytes | None:
        """What the socket holds now: bytes, b"" at EOF, None when there is nothing yet."""
        try:
            return self.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return b""

    def feed(self, data: bytes) -> tuple[list[Reply], str | None]:
        """The whole replies in what arrived so far, and what is wrong with the stream if something is
        (a frame over `MAX_REPLY_BYTES`, bytes that are not a reply): a worker that sends that is broken."""
        inbox = self.inbox
        inbox += data
        replies: list[Reply] = []
        while len(inbox) >= HEADER_BYTES:
            size = frame_length(inbox)
            if size > MAX_REPLY_BYTES:
                return replies, f"it sent a {size}-byte reply (at most {MAX_REPLY_BYTES})"
            if len(inbox) < HEADER_BYTES + size:
                break
            payload = bytes(inbox[HEADER_BYTES : HEADER_BYTES + size])
            del inbox[: HEADER_BYTES + size]
            try:
                replies.append(reply_decoder.decode(payload))
            except msgspec.DecodeError as exc:
                return replies, f"it sent a reply that is not valid: {exc}"
        return replies, None

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

    def release(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop watching its socket and process, and close them (after it exited)."""
        if self.pidfd is not None:
            loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        if self.sock.fileno() >= 0:
            loop.remove_reader(self.sock.fileno())
            loop.remove_writer(self.sock.fileno())
            self.sock.close()
