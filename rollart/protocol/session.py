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

The sequencing, resend buffer, acknowledgements and heartbeats are the session's `Link`
(`rollart.protocol.link`); this module adds requests, events and their handler on top.
`ClientSession` owns the connect loop; `SessionServer` accepts connections, authenticates them
and attaches them to their session. Both run over any `Connection` (TCP or in-memory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar, overload

import structlog

from rollart.errors import RollartError
from rollart.protocol.auth import Identity
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import (
    MessageDecodeError,
    RemoteError,
    RequestTimeout,
    SessionLost,
    UnexpectedReply,
)
from rollart.protocol.link import CLOCK_SLACK_S, Link, SessionStats, State
from rollart.protocol.messages import (
    DECODE_ERRORS,
    REMOTE_FAILURE,
    Channel,
    Kind,
    Msg,
    RemoteFailure,
    Request,
    reply_types,
)

__all__ = ["CLOCK_SLACK_S", "Handler", "Session", "SessionStats", "State"]

log = structlog.get_logger("rollart.protocol.session")

_ENVELOPE_BYTES = 64  # a Msg's own fields, bounded well above what they encode to
_NO_BODY = b"\xc0"  # msgpack nil: a Msg body is spliced in raw, so even "nothing" must be a value

R = TypeVar("R")


class Handler(Protocol):
    """What a node plugs into a session to serve its peer."""

    async def on_request(self, session: Session, msg: Any) -> Any:
        """Answer a request; raise `RemoteError` to send a specific error code."""

    async def on_event(self, session: Session, msg: Any) -> None:
        """Handle a one-way event; events are handled one at a time, in order."""


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    out: Msg
    """The request as sent, to send again if the peer loses the session."""


class Session(Link):
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
        super().__init__(session_id, local=local, cfg=cfg)
        self.channel = channel
        self.handler = handler
        self._next_corr = 0
        self._pending: dict[int, _Pending] = {}
        self._serving: dict[int, asyncio.Task[None]] = {}
        self._tg: asyncio.TaskGroup | None = None

    # -- sending ----------------------------------------------------------------------------

    async def send(self, msg: Any) -> None:
        """Send a one-way event; waits only while the resend buffer is full."""
        body = self.channel.encode(msg)
        if len(self._unacked) < self.cfg.resend_buffer and len(body) + _ENVELOPE_BYTES <= self.cfg.max_frame_bytes:
            self._emit_now(Kind.EVENT, 0, 0, body)  # the common case, without another coroutine
        else:
            await self._emit(Kind.EVENT, 0, 0, body)

    @overload
    async def request(self, msg: Request[R], *, timeout: float | None = None) -> R: ...

    @overload
    async def request(self, msg: object, *, timeout: float | None = None) -> object: ...

    async def request(self, msg: object, *, timeout: float | None = None) -> object:
        """Send a request and return the peer's response, of the type the request declares.

        Raises `RequestTimeout` past the deadline, `RemoteError` when the peer's handler failed,
        `UnexpectedReply` when it answered with another type than `msg` declares (`Request[R]`),
        `SessionLost` when the session ends first. Cancelling the caller cancels the handler.
        A message that declares no reply may still be sent as a request (a peer that serves none
        refuses it with a `RemoteError`); its answer comes back unchecked, typed `object`.
        """
        expected = reply_types(type(msg))
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
                reply = await future
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
        if expected is not None and not isinstance(reply, expected):
            wanted = " | ".join(t.__name__ for t in expected)
            raise UnexpectedReply(
                f"{self.channel.name} channel: {self._peer_name} answered {type(msg).__name__} with "
                f"{type(reply).__name__}; expected {wanted}"
            )
        return reply

    # -- receiving ----------------------------------------------------------------------------

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

    def _restart_numbering(self) -> None:
        """The peer lost this session's state: resend what it may not have, numbered afresh,
        including every request still waiting for a response."""
        for task in self._serving.values():
            task.cancel()  # their callers are gone with the old peer
        renumbered = self._renumber([pending.out for pending in self._pending.values()])
        for pending in self._pending.values():
            pending.out = renumbered[id(pending.out)]

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
        if not self._finished.is_set():
            for pending in self._pending.values():
                if not pending.future.done():
                    pending.future.set_exception(error)
            self._pending.clear()
        super()._finish(error, state)

    def serving_tasks(self) -> list[asyncio.Task[None]]:
        """The tasks answering the peer's requests right now."""
        return list(self._serving.values())

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
