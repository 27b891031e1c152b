"""The accepting end of persistent sessions.

`SessionServer` authenticates each connection (`auth.server_handshake`), then attaches it to
the session it names, creating the session or resuming it. A session whose client does not
come back within `linger_s` is forgotten. A connection opened for bulk payloads is handed to
`on_bulk` after the same handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from rollart.errors import RollartError
from rollart.protocol.auth import Identity, server_handshake
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, HandshakeRefused, ProtocolError, SessionLost
from rollart.protocol.framing import Connection, TcpConnection, serve_tcp
from rollart.protocol.messages import HANDSHAKE, Channel, Hello, Refuse
from rollart.protocol.session import Handler, Session, State
from rollart.protocol.tls import NodeTls, PlaintextPeer, TlsListener, TlsRefused

log = structlog.get_logger("rollart.protocol.server")

HANDSHAKE_MAX_FRAME_BYTES = 16 * 1024
"""The largest frame a connection may send before its handshake succeeds (a Hello is ~200 bytes)."""

REFUSAL_LINGER_S = 1.0
"""How long a refused connection stays half-open for its peer to read the refusal and hang up."""


JOB_ROLE = "env-host"
"""The only role another run's nodes have at a server that serves it (a shared reward gateway)."""

BulkHandler = Callable[[Connection, Identity], Awaitable[None]]


class SessionServer:
    """The accepting end: authenticates connections and attaches them to their sessions."""

    def __init__(
        self,
        *,
        local: Identity,
        secret: bytes,
        channel: Channel[Any],
        handler: Handler,
        cfg: SessionConfig,
        on_bulk: BulkHandler | None = None,
        tls: NodeTls | None = None,
        roles: Mapping[str, str] | None = None,
        jobs: Mapping[str, bytes] | None = None,
    ) -> None:
        """`tls`: every TCP connection is TLS (mutual certificates) before its handshake. `roles`: the
        peers this server has, node name -> role (a node's topology); a peer that proves the secret but
        claims a name or role not there is refused (`identity`): a node's secret and certificate let it
        be itself, not the trainer. None: any name and role. `jobs`: other runs this server serves (a
        shared reward gateway), job name -> the secret its nodes prove; their env-hosts say they are
        `job/node` (`JOB_ROLE`), and nothing else of theirs is let in."""
        self.roles = roles
        self.jobs = dict(jobs or {})
        self.local = local
        self.tls = tls
        self.channel = channel
        self.handler = handler
        self.cfg = cfg
        self.epoch = uuid.uuid4().hex
        self.sessions: dict[str, _ServerSession] = {}
        self.refusals = 0
        self._secret = secret
        self._on_bulk = on_bulk
        self._tg: asyncio.TaskGroup | None = None
        self._started = asyncio.Event()
        self._stopping = asyncio.Event()
        self._closing = False  # set when close() begins: no new connection or session after that
        self._listeners: list[asyncio.Server | TlsListener] = []

    async def serve(self) -> None:
        """Run until `close()`: owns every connection and session task."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            self._started.set()
            reaper = tg.create_task(self._reap())
            try:
                await self._stopping.wait()
            finally:
                # Cancelled too (the node failed): its listeners would go on accepting connections
                # into a task group that is gone.
                self._stop_accepting()
            reaper.cancel()

    async def listen_tcp(self, host: str, port: int) -> asyncio.Server | TlsListener:
        """Accept TCP connections on `host:port`, TLS first where the node has it (call after `serve()`
        has started)."""
        await self._started.wait()
        cfg = self.cfg
        server: asyncio.Server | TlsListener
        if self.tls is not None:
            server = await self.tls.serve(
                host,
                port,
                # The handshake's frame limit from the first byte: bytes may arrive before `accept` runs.
                lambda: TcpConnection(HANDSHAKE_MAX_FRAME_BYTES, cfg.max_bulk_bytes),
                on_connection=self._accept_tls,
                on_refused=self._tls_refused,
                timeout=cfg.handshake_timeout_s,
            )
        else:
            server = await serve_tcp(
                host, port, self.accept, max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes
            )
        self._listeners.append(server)
        return server

    def _accept_tls(self, conn: TcpConnection) -> None:
        conn.max_frame_bytes = self.cfg.max_frame_bytes  # the limit after the handshake; `accept` lowers it again
        self.accept(conn)

    def _tls_refused(self, peer: str, why: TlsRefused, conn: TcpConnection | None) -> None:
        self.refusals += 1
        log.warning("server.tls_refused", peer=peer, reason=str(why))
        if conn is None:
            return
        if isinstance(why, PlaintextPeer):  # it can read a refusal in plaintext: say why
            reason = f"node {self.local.node} accepts TLS connections only: set run.tls in this node's topology"
            with contextlib.suppress(RollartError):
                conn.send(HANDSHAKE.encode(Refuse("tls-required", reason)))
        conn.close()

    def accept(self, conn: Connection) -> None:
        """Take over a new connection (the listener's callback)."""
        if self._tg is None or self._closing:
            conn.close()
            return
        # Until the peer has proved it knows the secret, a frame header cannot make this node
        # reserve more than a handshake needs (a stranger announcing 16 MiB frames on many
        # connections would otherwise cost 16 MiB each). Set here, not in the task: the loop may
        # read the peer's first bytes before the task first runs (seen under load: 100 such
        # connections held 561 MiB).
        limit = conn.max_frame_bytes
        conn.max_frame_bytes = min(limit, HANDSHAKE_MAX_FRAME_BYTES)
        self._tg.create_task(self._handle(conn, limit))

    def _secret_for(self, hello: Hello) -> bytes:
        """The secret `hello`'s node must prove: its job's, for another run's node, else this run's."""
        job, slash, node = hello.node.partition("/")
        if not slash:
            return self._secret
        if job not in self.jobs or hello.role != JOB_ROLE or not node:
            known = ", ".join(sorted(self.jobs)) or "none"
            raise HandshakeRefused(
                "identity",
                f"{hello.node!r} ({hello.role}) is no {JOB_ROLE} of a job {self.local.node} serves (jobs: {known})",
            )
        return self.jobs[job]

    def _lookup(self, hello: Hello) -> tuple[str, bool, int]:
        if self._closing:
            # A session created now would outlive close() and keep serve() from returning; the
            # client sees a dropped connection and retries (a refusal would make it give up).
            raise ConnectionClosed(f"{self.local.node} is closing")
        if self.roles is not None and "/" not in hello.node and self.roles.get(hello.node) != hello.role:
            known = self.roles.get(hello.node)
            raise HandshakeRefused(
                "identity",
                f"node {hello.node!r} is no {hello.role} in this run's topology"
                + (f" (it is a {known})" if known else " (no such node)"),
            )
        if hello.purpose != "session":
            return self.epoch, False, 0
        session = self.sessions.get(hello.session_id)
        if session is not None and not session.finished:
            return self.epoch, True, session._received
        session = _ServerSession(self, hello.session_id)
        self.sessions[session.id] = session
        assert self._tg is not None
        self._tg.create_task(session.run())
        return self.epoch, False, 0

    async def _handle(self, conn: Connection, limit: int) -> None:
        """Authenticate `conn`, then serve it with its frame limit back at `limit`."""
        try:
            hello = await server_handshake(
                conn,
                identity=self.local,
                secret=self._secret_for if self.jobs else self._secret,
                lookup=self._lookup,
                timeout=self.cfg.handshake_timeout_s,
            )
        except HandshakeRefused:
            self.refusals += 1
            if isinstance(conn, TcpConnection):
                await conn.close_refused(REFUSAL_LINGER_S)
            else:  # in memory: frames sent stay readable after close
                conn.close()
            return
        except ConnectionClosed:
            conn.close()
            return
        except Exception:
            # Fault isolation before authentication too: whatever a stranger's bytes make the
            # handshake raise ends that connection, never the server (and is logged as the bug it is).
            self.refusals += 1
            log.exception("server.handshake_failed", peer=conn.peer)
            conn.close()
            return
        conn.max_frame_bytes = limit
        peer = Identity(hello.node, hello.role)
        try:
            if hello.purpose == "bulk":
                if self._on_bulk is None:
                    raise ProtocolError("this node accepts no bulk connections")
                await self._on_bulk(conn, peer)
            else:
                session = self.sessions[hello.session_id]
                session.peer = peer
                await session.attach(conn, hello.recv_seq)
        except (ConnectionClosed, ProtocolError) as exc:
            log.warning("server.connection_ended", peer=peer.node, error=str(exc))
        except Exception:
            # Fault isolation: one connection's failure must not stop the server.
            log.exception("server.connection_failed", peer=peer.node)
        finally:
            conn.close()

    async def _reap(self) -> None:
        """Forget sessions whose client has not come back within `linger_s`."""
        period = min(self.cfg.linger_s / 4, 5.0)
        while True:
            await asyncio.sleep(period)
            now = asyncio.get_running_loop().time()
            for sid, session in list(self.sessions.items()):
                if session.finished:
                    del self.sessions[sid]
                elif session.down_since is not None and now - session.down_since > self.cfg.linger_s:
                    log.info("server.session_expired", session=sid, peer=session._peer_name)
                    session._finish(SessionLost(f"session {sid}: client gone for {self.cfg.linger_s} s"), State.CLOSED)
                    del self.sessions[sid]

    def _stop_accepting(self) -> None:
        self._closing = True
        for listener in self._listeners:
            listener.close()

    async def close(self, reason: str = "server closing", *, timeout: float = 5.0) -> None:
        """Stop accepting, say `Bye` to every session (after its messages are acknowledged), stop."""
        self._stop_accepting()
        await asyncio.gather(*(s.close(reason, timeout=timeout) for s in list(self.sessions.values())))
        self._stopping.set()


class _ServerSession(Session):
    def __init__(self, server: SessionServer, session_id: str) -> None:
        super().__init__(session_id, local=server.local, channel=server.channel, handler=server.handler, cfg=server.cfg)

    def _on_bye(self, reason: str) -> None:
        log.info("session.client_bye", session=self.id, peer=self._peer_name, reason=reason)
        self._finish(SessionLost(f"session {self.id} closed by {self._peer_name}: {reason}"), State.CLOSED)

    async def run(self) -> None:
        await self._life(self._finished.wait)

    async def attach(self, conn: Connection, peer_recv_seq: int) -> None:
        """Serve `conn` for this session, replacing a connection the client has abandoned."""
        if self._conn is not None:
            self._conn.close()
        async with self._attach_lock:
            if self.finished:
                return
            log.info("session.attached", session=self.id, peer=self._peer_name, resumed=self.stats.connects > 0)
            await self._run_connection(conn, peer_recv_seq)
