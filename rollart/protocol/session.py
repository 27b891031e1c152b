"""Persistent sessions: exactly-once messaging that survives reconnects.

A `Session` is the state both ends keep for one logical link between two nodes. It outlives
TCP connections: when one drops, the client reconnects (exponential backoff, full jitter) and
resumes the same session id; unacknowledged messages are resent and duplicates are dropped by
sequence number, so nothing is lost or delivered twice.

- Every `Msg` has a per-direction sequence number. The receiver acknowledges the highest one it
  has *handled* (piggybacked on its own messages, or in an `Ack` sent at the end of the loop
  iteration), so a slow handler slows its sender instead of growing a queue.
- The sender keeps unacknowledged messages in a resend buffer of `resend_buffer` entries;
  `send` and `request` wait while it is full.
- `Ack` frames double as heartbeats; a peer heard nothing from for `heartbeat_deadline_s` is
  taken as gone and the connection is dropped (and re-established by the client).
- Requests carry a correlation id and a deadline; the caller gets the response, a
  `RemoteError`, or a `RequestTimeout`. A caller that times out or is cancelled sends a CANCEL,
  and the server cancels the handler.
- If the server restarted (new `epoch` in its `Welcome`), its state is gone: the client
  renumbers and resends its unacknowledged events and every request still waiting for a
  response. Requests are then executed at least once, responses still arrive exactly once.
- `Bye` ends a session on purpose: a server that drains tells clients to start fresh when it is
  back; a client that closes lets the server forget it.

`ClientSession` owns the connect loop; `SessionServer` accepts connections, authenticates them
and attaches them to their session. Both run over any `Connection` (TCP or in-memory).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import msgspec
import structlog

from rollart.errors import RollartError
from rollart.protocol.auth import Identity
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import (
    ConnectionClosed,
    FrameTooLarge,
    MessageDecodeError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    SessionLost,
)
from rollart.protocol.framing import Connection, TcpConnection
from rollart.protocol.messages import (
    DECODE_ERRORS,
    REMOTE_FAILURE,
    SESSION,
    Ack,
    Bye,
    Channel,
    Kind,
    Msg,
    RemoteFailure,
)

log = structlog.get_logger("rollart.protocol.session")

CLOCK_SLACK_S = 1e-6
"""How far before a timer's deadline a clock reading still counts as at it (see `_heartbeat`)."""
_ENVELOPE_BYTES = 64  # a Msg's own fields, bounded well above what they encode to
_NO_BODY = b"\xc0"  # msgpack nil: a Msg body is spliced in raw, so even "nothing" must be a value


class Handler(Protocol):
    """What a node plugs into a session to serve its peer."""

    async def on_request(self, session: Session, msg: Any) -> Any:
        """Answer a request; raise `RemoteError` to send a specific error code."""

    async def on_event(self, session: Session, msg: Any) -> None:
        """Handle a one-way event; events are handled one at a time, in order."""


class State(enum.StrEnum):
    CONNECTING = "connecting"
    UP = "up"
    DOWN = "down"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(slots=True)
class SessionStats:
    """Counters read by the node's metrics collector and `/status`."""

    sent: int = 0
    received: int = 0
    resent: int = 0
    duplicates: int = 0
    connects: int = 0
    disconnects: int = 0
    silent_peer: int = 0
    requests_sent: int = 0
    requests_served: int = 0
    request_timeouts: int = 0
    late_responses: int = 0
    decode_errors: int = 0
    handler_errors: int = 0


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    out: Msg
    """The request as sent, to send again if the peer loses the session."""


class Session:
    """One end of a persistent session. Use `ClientSession` or get one from `SessionServer`."""

    def __init__(
        self,
        session_id: str,
        *,
        local: Identity,
        channel: Channel[Any],
        handler: Handler | None,
        cfg: SessionConfig,
    ) -> None:
        self.id = session_id
        self.local = local
        self.peer: Identity | None = None
        self.channel = channel
        self.handler = handler
        self.cfg = cfg
        self.state = State.CONNECTING
        self.stats = SessionStats()
        self.up = asyncio.Event()
        self.down = asyncio.Event()
        """Set while the session has no live connection (callers can fail fast on it)."""
        self.down.set()
        self.last_heard = 0.0
        self.down_since: float | None = None
        self.last_connected = 0.0
        self._loop = asyncio.get_running_loop()
        self._conn: Connection | None = None
        self._attach_lock = asyncio.Lock()
        self._send_seq = 0
        self._unacked: collections.deque[Msg] = collections.deque()  # the resend buffer
        self._space = asyncio.Event()
        self._space.set()
        self._all_acked = asyncio.Event()
        self._all_acked.set()
        self._received = 0  # highest contiguous seq received from the peer
        self._delivered = 0  # highest seq handled: what we acknowledge
        self._acked_sent = 0
        self._ack_scheduled = False
        self._ack_every = max(1, cfg.resend_buffer // 4)
        self._generation = 0  # bumped when the peer lost our session and numbering restarts
        self._inbox: collections.deque[tuple[int, list[Msg]]] = collections.deque()  # (generation, batch)
        self._inbox_ready = asyncio.Event()
        self._next_corr = 0
        self._pending: dict[int, _Pending] = {}
        self._serving: dict[int, asyncio.Task[None]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._error: RollartError | None = None
        self._finished = asyncio.Event()

    # -- sending ----------------------------------------------------------------------------

    async def send(self, msg: Any) -> None:
        """Send a one-way event; waits only while the resend buffer is full."""
        body = self.channel.encode(msg)
        if len(self._unacked) < self.cfg.resend_buffer and len(body) + _ENVELOPE_BYTES <= self.cfg.max_frame_bytes:
            self._emit_now(Kind.EVENT, 0, 0, body)  # the common case, without another coroutine
        else:
            await self._emit(Kind.EVENT, 0, 0, body)

    async def request(self, msg: Any, *, timeout: float | None = None) -> Any:
        """Send a request and return the peer's response.

        Raises `RequestTimeout` past the deadline, `RemoteError` when the peer's handler failed,
        `SessionLost` when the session ends first. Cancelling the caller cancels the handler.
        """
        timeout = self.cfg.default_request_timeout_s if timeout is None else timeout
        self._next_corr += 1
        corr = self._next_corr
        future: asyncio.Future[Any] = self._loop.create_future()
        body = self.channel.encode(msg)
        self.stats.requests_sent += 1
        try:
            async with asyncio.timeout(timeout):
                out = await self._emit(Kind.REQUEST, corr, max(1, int(timeout * 1000)), body)
                self._pending[corr] = _Pending(future, out)
                return await future
        except TimeoutError:
            self.stats.request_timeouts += 1
            raise RequestTimeout(
                f"{type(msg).__name__} request to {self._peer_name} timed out after {timeout} s"
            ) from None
        finally:
            # A timeout or a cancelled caller cancels `future` too, so "no answer came" is
            # "still pending" (a response pops it), not "future not done".
            if self._pending.pop(corr, None) is not None and self._error is None:
                self._emit_now(Kind.CANCEL, corr, 0, _NO_BODY)

    async def _emit(self, kind: Kind, corr: int, timeout_ms: int, body: bytes) -> Msg:
        if len(body) + _ENVELOPE_BYTES > self.cfg.max_frame_bytes:
            raise FrameTooLarge(f"message of {len(body)} bytes exceeds the frame limit of {self.cfg.max_frame_bytes}")
        while len(self._unacked) >= self.cfg.resend_buffer and self._error is None:
            self._space.clear()
            await self._space.wait()
        return self._emit_now(kind, corr, timeout_ms, body)

    def _emit_now(self, kind: Kind, corr: int, timeout_ms: int, body: bytes) -> Msg:
        """Sequence and send without waiting for room (responses and cancels must not block).

        This is the hot path of every message: it is kept flat on purpose.
        """
        if self._error is not None:
            raise self._error
        self._send_seq += 1
        msg = Msg(self._send_seq, self._delivered, kind, corr, timeout_ms, msgspec.Raw(body))
        self._unacked.append(msg)
        if self._all_acked.is_set():
            self._all_acked.clear()
        self._transmit(msg)
        return msg

    def _transmit(self, msg: Msg) -> None:
        conn = self._conn
        if conn is None:
            return  # kept in the resend buffer until the next connection
        try:
            conn.send(SESSION.encode(msg))
        except ConnectionClosed:
            return
        self._acked_sent = msg.ack
        self.stats.sent += 1

    def _on_ack(self, ack: int) -> None:
        unacked = self._unacked
        while unacked and unacked[0].seq <= ack:
            unacked.popleft()
        if len(unacked) < self.cfg.resend_buffer:
            self._space.set()
        if not unacked:
            self._all_acked.set()

    def _schedule_ack(self) -> None:
        if self._delivered - self._acked_sent >= self._ack_every:
            self._send_ack()
        elif not self._ack_scheduled:
            self._ack_scheduled = True
            self._loop.call_soon(self._send_ack)

    def _send_ack(self) -> None:
        self._ack_scheduled = False
        conn = self._conn
        if conn is None or self._delivered == self._acked_sent:
            return
        with contextlib.suppress(ConnectionClosed):  # acknowledged again on the next connection
            conn.send(SESSION.encode(Ack(self._delivered)))
            self._acked_sent = self._delivered

    # -- receiving ----------------------------------------------------------------------------

    async def _read(self, conn: Connection) -> str:
        decode = SESSION.decode_native
        while True:
            frames = await conn.recv_batch()
            self.last_heard = self._loop.time()
            ack = -1
            accepted: list[Msg] = []
            try:
                for raw in frames:
                    match decode(raw):
                        case Msg() as msg:
                            ack = max(ack, msg.ack)
                            if msg.seq <= self._received:
                                self.stats.duplicates += 1
                            elif msg.seq == self._received + 1:
                                self._received = msg.seq
                                accepted.append(msg)
                            else:
                                raise ProtocolError(f"sequence gap: expected {self._received + 1}, got {msg.seq}")
                        case Ack() as frame:
                            ack = max(ack, frame.ack)
                        case Bye(reason=reason):
                            self._on_bye(reason)
                            return f"peer said bye: {reason}"
            except DECODE_ERRORS as exc:
                raise SESSION.explain(exc) from None
            finally:  # what arrived before a bad frame or a Bye is still handled
                if ack >= 0:
                    self._on_ack(ack)
                if accepted:
                    self.stats.received += len(accepted)
                    self._inbox.append((self._generation, accepted))
                    self._inbox_ready.set()

    def _on_bye(self, reason: str) -> None:
        """The peer ended the session on purpose; each end reacts in its own way."""
        raise NotImplementedError

    async def _dispatch(self) -> None:
        """Handle received messages one at a time, in order; requests each get a task."""
        inbox = self._inbox
        while True:
            while not inbox:
                self._inbox_ready.clear()
                await self._inbox_ready.wait()
            generation, batch = inbox.popleft()
            for msg in batch:
                match msg.kind:
                    case Kind.EVENT:
                        await self._handle_event(msg)
                    case Kind.REQUEST:
                        assert self._tg is not None
                        self._serving[msg.corr] = self._tg.create_task(self._serve(msg))
                    case Kind.RESPONSE | Kind.ERROR:
                        self._resolve(msg)
                    case Kind.CANCEL:
                        task = self._serving.pop(msg.corr, None)
                        if task is not None:
                            task.cancel()
                if generation == self._generation:
                    self._delivered = msg.seq
            self._schedule_ack()

    async def _handle_event(self, msg: Msg) -> None:
        try:
            event = self.channel.decode_native(msg.body)
        except DECODE_ERRORS as exc:
            self.stats.decode_errors += 1
            log.error("session.bad_event", session=self.id, peer=self._peer_name, error=str(self.channel.explain(exc)))
            return
        if self.handler is None:
            log.warning("session.unhandled_event", session=self.id, message=type(event).__name__)
            return
        try:
            await self.handler.on_event(self, event)
        except Exception:
            # Fault isolation: one failing event handler must not take the session down.
            self.stats.handler_errors += 1
            log.exception("session.event_handler_failed", session=self.id, message=type(event).__name__)

    async def _serve(self, msg: Msg) -> None:
        self.stats.requests_served += 1
        try:
            request = self.channel.decode(msg.body)
            if self.handler is None:
                raise RemoteError("no-handler", f"{self.local.node} serves no requests on this session")
            async with asyncio.timeout(msg.timeout_ms / 1000 if msg.timeout_ms else None):
                reply = await self.handler.on_request(self, request)
            self._reply(msg.corr, Kind.RESPONSE, self.channel.encode(reply))
        except MessageDecodeError as exc:
            self.stats.decode_errors += 1
            self._fail_request(msg.corr, "bad-request", str(exc))
        except RemoteError as exc:
            self._fail_request(msg.corr, exc.code, exc.message)
        except TimeoutError:
            self._fail_request(msg.corr, "timeout", f"not answered within {msg.timeout_ms} ms")
        except Exception as exc:
            # Fault isolation: the handler's bug becomes the caller's RemoteError, not a crash.
            self.stats.handler_errors += 1
            log.exception("session.request_handler_failed", session=self.id, peer=self._peer_name)
            self._fail_request(msg.corr, "handler-error", f"{type(exc).__name__}: {exc}")
        finally:
            self._serving.pop(msg.corr, None)

    def _reply(self, corr: int, kind: Kind, body: bytes) -> None:
        if self._error is None:
            self._emit_now(kind, corr, 0, body)

    def _fail_request(self, corr: int, code: str, message: str) -> None:
        self._reply(corr, Kind.ERROR, REMOTE_FAILURE.encode(RemoteFailure(code, message)))

    def _resolve(self, msg: Msg) -> None:
        pending = self._pending.pop(msg.corr, None)
        if pending is None or pending.future.done():
            self.stats.late_responses += 1
            return
        try:
            if msg.kind is Kind.RESPONSE:
                pending.future.set_result(self.channel.decode(msg.body))
            else:
                failure = REMOTE_FAILURE.decode(msg.body)
                pending.future.set_exception(RemoteError(failure.code, failure.message))
        except MessageDecodeError as exc:
            self.stats.decode_errors += 1
            pending.future.set_exception(exc)

    # -- connections --------------------------------------------------------------------------

    async def _run_connection(self, conn: Connection, peer_recv_seq: int) -> str:
        """Serve one connection until it drops; returns why it ended."""
        self._conn = conn
        self.last_connected = self._loop.time()
        self.state = State.UP
        self.down_since = None
        self.last_heard = self._loop.time()
        self.stats.connects += 1
        self.up.set()
        self.down.clear()
        self._on_ack(peer_recv_seq)
        for msg in self._unacked:
            self._transmit(msgspec.structs.replace(msg, ack=self._delivered))
            self.stats.resent += 1
        reader = asyncio.ensure_future(self._read(conn))
        heartbeat = asyncio.ensure_future(self._heartbeat(conn))
        why = "closed"
        try:
            done, _ = await asyncio.wait([reader, heartbeat], return_when=asyncio.FIRST_COMPLETED)
            task = done.pop()
            exc = task.exception()
            why = task.result() if exc is None else f"{type(exc).__name__}: {exc}"
            if isinstance(exc, MessageDecodeError | ProtocolError):
                log.error("session.protocol_error", session=self.id, peer=self._peer_name, error=str(exc))
            elif exc is not None and not isinstance(exc, ConnectionClosed | OSError):
                raise exc
        finally:
            reader.cancel()
            heartbeat.cancel()
            await asyncio.gather(reader, heartbeat, return_exceptions=True)
            conn.abort() if isinstance(conn, TcpConnection) else conn.close()
            self._conn = None
            self.up.clear()
            self.down.set()
            self.stats.disconnects += 1
            if self.state is State.UP:
                self.state = State.DOWN
                self.down_since = self._loop.time()
        log.info("session.disconnected", session=self.id, peer=self._peer_name, why=why)
        return why

    async def _heartbeat(self, conn: Connection) -> str:
        interval, deadline = self.cfg.heartbeat_interval_s, self.cfg.heartbeat_deadline_s
        next_beat = self._loop.time()
        while True:
            # A clock read as a hair before the timer it woke from still counts as there: a virtual
            # clock (looptime) rounds to microseconds, and 0.4 + 0.2 > 0.6 would otherwise spin.
            now = self._loop.time() + CLOCK_SLACK_S
            silent_until = self.last_heard + deadline
            if now >= silent_until:
                self.stats.silent_peer += 1
                log.warning("session.peer_silent", session=self.id, peer=self._peer_name, deadline_s=deadline)
                return f"peer silent for {deadline} s"
            if now >= next_beat:
                conn.send(SESSION.encode(Ack(self._delivered)))
                self._acked_sent = self._delivered
                next_beat = now + interval
            await asyncio.sleep(min(next_beat, silent_until) - now + CLOCK_SLACK_S)

    def _restart_numbering(self) -> None:
        """The peer lost this session's state: resend what it may not have, numbered afresh."""
        self._generation += 1
        self._received = self._delivered = self._acked_sent = 0
        keep = {id(msg): msg for msg in self._unacked if msg.kind in (Kind.EVENT, Kind.REQUEST)}
        for pending in self._pending.values():
            keep.setdefault(id(pending.out), pending.out)
        for task in self._serving.values():
            task.cancel()  # their callers are gone with the old peer
        renumbered = {
            key: msgspec.structs.replace(msg, seq=seq, ack=0)
            for seq, (key, msg) in enumerate(sorted(keep.items(), key=lambda item: item[1].seq), start=1)
        }
        for pending in self._pending.values():
            pending.out = renumbered[id(pending.out)]
        self._send_seq = len(renumbered)
        self._unacked = collections.deque(renumbered.values())
        self._on_ack(0)

    # -- lifetime -----------------------------------------------------------------------------

    async def _life(self, body: Callable[[], Awaitable[object]]) -> None:
        """Run the dispatcher and `body` under one task group; end both when the session ends.

        `SessionLost` from `body` (gave up, refused) is raised as itself: an exception raised in a
        task group's body would otherwise reach the owner wrapped in an `ExceptionGroup`.
        """
        lost: SessionLost | None = None
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            dispatcher = tg.create_task(self._dispatch())
            try:
                await body()
            except SessionLost as exc:
                lost = exc
            finally:
                dispatcher.cancel()
                for task in list(self._serving.values()):
                    task.cancel()
        if lost is not None:
            raise lost

    def _finish(self, error: RollartError, state: State) -> None:
        if self._finished.is_set():
            return
        self._error = error
        self.state = state
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()
        self._space.set()
        self._all_acked.set()
        self._finished.set()
        if self._conn is not None:
            self._conn.close()

    async def close(self, reason: str = "closed", *, timeout: float = 5.0) -> None:
        """End the session on purpose: wait (up to `timeout`) for the peer to acknowledge what was
        sent, tell it `Bye`, and fail whatever still waits on this session."""
        if self._finished.is_set():
            return
        try:
            async with asyncio.timeout(timeout):
                await self._all_acked.wait()
        except TimeoutError:
            log.warning("session.close_unacked", session=self.id, peer=self._peer_name, unacked=len(self._unacked))
        if self._conn is not None:
            self._send_ack()
            # If this fails, the peer forgets the session when its linger time runs out.
            with contextlib.suppress(ConnectionClosed):
                self._conn.send(SESSION.encode(Bye(reason)))
        self._finish(SessionLost(f"session {self.id} closed: {reason}"), State.CLOSED)

    def serving_tasks(self) -> list[asyncio.Task[None]]:
        """The tasks answering the peer's requests right now."""
        return list(self._serving.values())

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def _peer_name(self) -> str:
        return self.peer.node if self.peer else "?"

    def describe(self) -> dict[str, Any]:
        """The session's state for `/status`."""
        return {
            "id": self.id,
            "peer": self._peer_name,
            "peer_role": self.peer.role if self.peer else None,
            "state": str(self.state),
            "unacked": len(self._unacked),
            "pending_requests": len(self._pending),
            "serving": len(self._serving),
            "inbox": sum(len(batch) for _, batch in self._inbox),
            "last_heard_s_ago": round(self._loop.time() - self.last_heard, 3) if self.last_heard else None,
            **asdict(self.stats),
        }
