"""The connecting end of a persistent session: connect, authenticate, resume, reconnect.

`ClientSession.run()` keeps a connection up until the session is closed, reconnecting with
exponential backoff and full jitter (`backoff_base_s` doubling up to `backoff_cap_s`); it gives
up, failing every pending request with `SessionLost`, after `give_up_after_s` without a
connection or at once when the server refuses the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from rollart.protocol.auth import Identity, client_handshake
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, HandshakeRefused, ProtocolError, SessionLost
from rollart.protocol.framing import Connection, open_tcp
from rollart.protocol.messages import Channel
from rollart.protocol.retry import Backoff
from rollart.protocol.session import Handler, Session, State
from rollart.protocol.tls import NodeTls

log = structlog.get_logger("rollart.protocol.client")


Connector = Callable[[], Awaitable[Connection]]


class ClientSession(Session):
    """The connecting end: keeps a connection up, reconnecting with backoff, until closed.

    Run `await session.run()` in the owner's task group; it returns when the session is closed and
    raises `SessionLost` when it gave up (no connection for `give_up_after_s`, or refused).
    """

    def __init__(
        self,
        connect: Connector,
        *,
        secret: bytes,
        local: Identity,
        channel: Channel[Any],
        handler: Handler | None = None,
        cfg: SessionConfig,
        peer_name: str = "?",
        session_id: str | None = None,
    ) -> None:
        super().__init__(session_id or uuid.uuid4().hex, local=local, channel=channel, handler=handler, cfg=cfg)
        self._connect = connect
        self._secret = secret
        self._peer_epoch: str | None = None
        self._backoff = Backoff(cfg.backoff_base_s, cfg.backoff_cap_s)  # full jitter
        self.peer = Identity(peer_name, "?")

    def _on_bye(self, reason: str) -> None:
        # A draining server dropped our state; the next connection starts a fresh numbering.
        log.info("session.server_bye", session=self.id, peer=self._peer_name, reason=reason)
        self._peer_epoch = None

    async def run(self) -> None:
        await self._life(self._connect_loop)

    async def _connect_loop(self) -> None:
        cfg = self.cfg
        attempt = 0
        down_since = self._loop.time()
        while not self._finished.is_set():
            conn: Connection | None = None
            try:
                async with asyncio.timeout(cfg.handshake_timeout_s):
                    conn = await self._connect()
                welcome, peer = await client_handshake(
                    conn,
                    identity=self.local,
                    secret=self._secret,
                    session_id=self.id,
                    recv_seq=self._received,
                    timeout=cfg.handshake_timeout_s,
                )
            except (HandshakeRefused, ProtocolError) as exc:
                if conn is not None:
                    conn.close()
                log.error("session.refused", session=self.id, peer=self._peer_name, error=str(exc))
                self._finish(SessionLost(f"session to {self._peer_name}: {exc}"), State.FAILED)
                raise self._error from exc  # type: ignore[misc]
            except (OSError, TimeoutError, ConnectionClosed) as exc:
                if conn is not None:
                    conn.close()
                waited = self._loop.time() - down_since
                if waited >= cfg.give_up_after_s:
                    log.error("session.gave_up", session=self.id, peer=self._peer_name, after_s=round(waited, 1))
                    self._finish(
                        SessionLost(f"session to {self._peer_name}: no connection for {waited:.0f} s ({exc})"),
                        State.FAILED,
                    )
                    raise self._error from exc  # type: ignore[misc]
                log.debug("session.retry", session=self.id, peer=self._peer_name, attempt=attempt, error=str(exc))
                await self._back_off(attempt, limit=cfg.give_up_after_s - waited)
                attempt += 1
                continue
            if self._finished.is_set():
                conn.close()
                return
            self.peer = peer
            resumed = welcome.resumed and welcome.epoch == self._peer_epoch
            if not resumed:
                self._restart_numbering()
                self._peer_epoch = welcome.epoch
            log.info("session.connected", session=self.id, peer=peer.node, resumed=resumed, attempts=attempt + 1)
            await self._run_connection(conn, welcome.recv_seq if resumed else 0)
            lasted = self._loop.time() - self.last_connected
            down_since = self._loop.time()
            if lasted >= cfg.heartbeat_deadline_s:
                attempt = 0  # a connection that held resets the backoff; one that breaks at once does not
            else:
                await self._back_off(attempt, limit=cfg.backoff_cap_s)
                attempt += 1

    async def _back_off(self, attempt: int, *, limit: float) -> None:
        """Sleep a full-jitter delay for this attempt (at most `limit`); `close()` ends it early."""
        delay = min(limit, self._backoff.delay(attempt))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._finished.wait(), max(0.0, delay))


async def tcp_connector(host: str, port: int, cfg: SessionConfig, tls: NodeTls | None = None) -> Connection:
    """Open a TCP connection with the session's frame limits, over TLS when `tls` is given (for
    `ClientSession(connect=...)`)."""
    return await open_tcp(
        host,
        port,
        max_frame_bytes=cfg.max_frame_bytes,
        max_bulk_bytes=cfg.max_bulk_bytes,
        timeout=cfg.handshake_timeout_s,
        tls=tls,
    )
