"""The sequenced link under a session: exactly-once, in-order delivery over reconnecting connections.

`Link` is the half of `Session` that knows no requests, events or handlers: it numbers what it
sends, keeps it in a resend buffer until the peer acknowledges it, resends it on the next
connection, drops duplicates, acknowledges what was handled, sends heartbeats and notices a silent
peer. What arrives is queued in `_inbox` for the session's dispatcher. The rules it follows are in
`rollart.protocol.session`'s docstring.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
from dataclasses import dataclass

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
    SessionLost,
)
from rollart.protocol.framing import Connection, SoonOnce, TcpConnection
from rollart.protocol.messages import DECODE_ERRORS, SESSION, Ack, Bye, Kind, Msg

log = structlog.get_logger("rollart.protocol.session")

CLOCK_SLACK_S = 1e-6
"""How far before a timer's deadline a clock reading still counts as at it (see `_heartbeat`)."""
_ENVELOPE_BYTES = 64  # a Msg's own fields, bounded well above what they encode to


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


class Link:
    """The sequencing, resend buffer, acknowledgements and connection loop of one session end."""

    def __init__(self, session_id: str, *, local: Identity, cfg: SessionConfig) -> None:
        self.id = session_id
        self.local = local
        self.peer: Identity | None = None
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
        self._ack = SoonOnce(self._send_ack, self._loop)
        self._ack_every = max(1, cfg.resend_buffer // 4)
        self._generation = 0  # bumped when the peer lost our session and numbering restarts
        self._inbox: collections.deque[tuple[int, list[Msg]]] = collections.deque()  # (generation, batch)
        self._inbox_ready = asyncio.Event()
        self._error: RollartError | None = None
        self._finished = asyncio.Event()

    # -- sending ----------------------------------------------------------------------------

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
            self._ack()
        else:
            self._ack.soon()

    def _send_ack(self) -> None:
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
        self._renumber([])

    def _renumber(self, also: list[Msg]) -> dict[int, Msg]:
        """Renumber the unacknowledged events and requests, and `also` (requests still waiting for
        a response), from 1 in their old order; returns old message's id() -> renumbered message."""
        self._generation += 1
        self._received = self._delivered = self._acked_sent = 0
        keep = {id(msg): msg for msg in self._unacked if msg.kind in (Kind.EVENT, Kind.REQUEST)}
        for msg in also:
            keep.setdefault(id(msg), msg)
        renumbered = {
            key: msgspec.structs.replace(msg, seq=seq, ack=0)
            for seq, (key, msg) in enumerate(sorted(keep.items(), key=lambda item: item[1].seq), start=1)
        }
        self._send_seq = len(renumbered)
        self._unacked = collections.deque(renumbered.values())
        self._on_ack(0)
        return renumbered

    # -- lifetime -----------------------------------------------------------------------------

    def _finish(self, error: RollartError, state: State) -> None:
        if self._finished.is_set():
            return
        self._error = error
        self.state = state
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
            self._ack()
            # If this fails, the peer forgets the session when its linger time runs out.
            with contextlib.suppress(ConnectionClosed):
                self._conn.send(SESSION.encode(Bye(reason)))
        self._finish(SessionLost(f"session {self.id} closed: {reason}"), State.CLOSED)

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def _peer_name(self) -> str:
        return self.peer.node if self.peer else "?"
