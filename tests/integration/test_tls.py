"""TLS between nodes over real loopback TCP: sessions and bulk connections with mutual certificates,
and what an on-path attacker or a misconfigured peer gets.

- a session and a bulk payload over TLS, with the channel binding both ends computed alike;
- tampering: a proxy flips one byte of a frame after the handshake; TLS's record tag fails, the
  connection drops, nothing of it is applied, and the session resumes on a new connection with every
  request answered once;
- a handshake relayed between two TLS connections (by someone holding CA-signed certificates with the
  right names) fails its proofs: the certificates under the two connections differ;
- a plaintext client against a TLS node, and a TLS client against a plaintext node, are refused
  with a message that says so; expired, foreign-CA and someone else's certificates are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop
from structlog.testing import capture_logs

from rollart.errors import ConfigError
from rollart.protocol import tls as tls_module
from rollart.protocol.auth import Identity, client_handshake
from rollart.protocol.bulk import open_bulk, recv_blob, send_blob
from rollart.protocol.certs import NodeName, issue, issue_for_nodes, make_ca, write_private
from rollart.protocol.client import ClientSession, tcp_connector
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import HandshakeRefused, SessionLost
from rollart.protocol.framing import Connection, TcpConnection, open_tcp
from rollart.protocol.messages import CONTROL, BlobHeader, Echo
from rollart.protocol.server import SessionServer
from rollart.protocol.session import Session
from rollart.protocol.tls import NodeTls
from rollart.testkit.ports import free_ports

pytestmark = pytest.mark.integration

SECRET = b"tls test secret"
CFG = SessionConfig(
    heartbeat_interval_s=0.1,
    heartbeat_deadline_s=0.6,
    handshake_timeout_s=2.0,
    backoff_base_s=0.02,
    backoff_cap_s=0.1,
    give_up_after_s=10.0,
    default_request_timeout_s=10.0,
)
SERVER = Identity("trainer-0", "trainer")
CLIENT = Identity("gen-0", "generator")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CA with certificates for both nodes; beside it, `dup/` (the same CA, the same names, other
    keys: what a relaying attacker would need), `other/` (another CA) and `expired/`."""
    folder = tmp_path_factory.mktemp("certs")
    issue_for_nodes(folder, [NodeName("trainer-0"), NodeName("gen-0")])
    ca, ca_key = (folder / "ca.pem").read_bytes(), (folder / "ca.key").read_bytes()
    dup = folder / "dup"
    dup.mkdir()
    (dup / "ca.pem").write_bytes(ca)
    for name in ("trainer-0", "gen-0"):
        cert, key = issue(ca, ca_key, NodeName(name))
        (dup / f"{name}.pem").write_bytes(cert)
        write_private(dup / f"{name}.key", key)
    issue_for_nodes(folder / "other", [NodeName("gen-0")])
    expired = folder / "expired"
    expired.mkdir()
    (expired / "ca.pem").write_bytes(ca)
    long_ago = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    cert, key = issue(ca, ca_key, NodeName("gen-0"), days=2, not_before=long_ago)
    (expired / "gen-0.pem").write_bytes(cert)
    write_private(expired / "gen-0.key", key)
    return folder


def node_tls(folder: Path, name: str) -> NodeTls:
    return NodeTls(folder / "ca.pem", folder / f"{name}.pem", folder / f"{name}.key")


class EchoHandler:
    def __init__(self) -> None:
        self.seen: list[int] = []

    async def on_request(self, session: Session, msg: Any) -> Any:
        self.seen.append(msg.n)
        return msg

    async def on_event(self, session: Session, msg: Any) -> None:
        pass


@contextlib.asynccontextmanager
async def tls_server(port: int, tls: NodeTls | None, **kwargs: Any) -> AsyncIterator[SessionServer]:
    server = SessionServer(
        local=SERVER, secret=SECRET, channel=CONTROL, handler=EchoHandler(), cfg=CFG, tls=tls, **kwargs
    )
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        await server.listen_tcp("127.0.0.1", port)
        try:
            yield server
        finally:
            await server.close()


def client(port: int, tls: NodeTls | None, cfg: SessionConfig = CFG) -> ClientSession:
    return ClientSession(
        lambda: tcp_connector("127.0.0.1", port, cfg, tls),
        secret=SECRET,
        local=CLIENT,
        channel=CONTROL,
        cfg=cfg,
        peer_name=SERVER.node,
    )


@pytest.mark.timeout(30)
async def test_tls_session_and_bulk(certs: Path, free_port: int) -> None:
    payload = random.Random(1).randbytes(4 * 2**20)
    received: asyncio.Future[tuple[BlobHeader, bytes, Identity]] = asyncio.get_running_loop().create_future()

    async def on_bulk(conn: Connection, peer: Identity) -> None:
        header, data = await recv_blob(conn)
        received.set_result((header, bytes(data), peer))

    async with tls_server(free_port, node_tls(certs, "trainer-0"), on_bulk=on_bulk), asyncio.TaskGroup() as tg:
        session = client(free_port, node_tls(certs, "gen-0"))
        tg.create_task(session.run())
        assert await session.request(Echo(1, b"over tls")) == Echo(1, b"over tls")
        conn = session._conn
        assert isinstance(conn, TcpConnection) and conn.tls is not None
        assert conn.tls.name == "trainer-0"
        bulk = await open_bulk(
            "127.0.0.1", free_port, local=CLIENT, secret=SECRET, cfg=CFG, tls=node_tls(certs, "gen-0")
        )
        try:
            await send_blob(bulk, "weights-v1", payload, {"version": 1})
            header, data, peer = await asyncio.wait_for(received, 10)
        finally:
            bulk.close()
        await session.close()
    assert header == BlobHeader("weights-v1", len(payload), {"version": 1})
    assert data == payload
    assert peer == CLIENT


class FlipProxy:
    """Forwards loopback TCP to `target`; on its first connection, flips one bit of the client's stream
    at byte `at` (past both handshakes), once."""

    def __init__(self, target: int, at: int) -> None:
        self.target, self.at = target, at
        self.flipped = False
        self.connections = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        flip = not self.flipped
        self.flipped = True
        for src, dst, tamper in ((reader, up_w, flip), (up_r, writer, False)):
            task = asyncio.ensure_future(self._pump(src, dst, tamper))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, tamper: bool) -> None:
        passed = 0
        try:
            while data := await src.read(65536):
                if tamper and passed <= self.at < passed + len(data):
                    changed = bytearray(data)
                    changed[self.at - passed] ^= 0x01
                    data = bytes(changed)
                passed += len(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()


@pytest.mark.timeout(30)
async def test_tls_tamper_one_byte_drops_the_connection_and_the_session_resumes(certs: Path, free_port: int) -> None:
    node_port, proxy_port = free_port, free_ports(1)[0]
    # Past TLS's handshake (~1.5 KiB from the client) and ours, inside the first requests' records.
    proxy = FlipProxy(node_port, at=6000)
    listener = await asyncio.start_server(proxy.accept, "127.0.0.1", proxy_port)
    async with tls_server(node_port, node_tls(certs, "trainer-0")) as server, asyncio.TaskGroup() as tg:
        session = client(proxy_port, node_tls(certs, "gen-0"))
        tg.create_task(session.run())
        with capture_logs() as logs:
            replies = [await session.request(Echo(i, bytes(200))) for i in range(100)]
        await session.close()
    listener.close()
    assert replies == [Echo(i, bytes(200)) for i in range(100)]
    assert proxy.flipped and proxy.connections >= 2, "the flipped byte should have cost the first connection"
    handler = server.handler
    assert isinstance(handler, EchoHandler)
    assert sorted(set(handler.seen)) == list(range(100))
    assert len(handler.seen) == 100, "a request was applied twice, or one from the tampered record was applied"
    assert session.stats.connects >= 2
    dropped = [e for e in logs if e["event"] == "session.disconnected"]
    assert dropped, logs


class Relay:
    """An attacker in the middle holding CA-signed certificates with the right names (`dup/`): it ends
    the client's TLS with its own 'trainer-0' certificate, opens its own TLS to the server as 'gen-0',
    and passes the handshake's frames along unchanged."""

    def __init__(self, certs: Path, target: int) -> None:
        self.as_server = node_tls(certs / "dup", "trainer-0")
        self.as_client = node_tls(certs / "dup", "gen-0")
        self.target = target
        self._tasks: set[asyncio.Task[None]] = set()

    def accept(self, conn: TcpConnection) -> None:
        task = asyncio.ensure_future(self._relay(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(self, down: TcpConnection) -> None:
        up = await open_tcp(
            "127.0.0.1", self.target, max_frame_bytes=2**20, max_bulk_bytes=2**20, timeout=5, tls=self.as_client
        )

        async def pump(src: TcpConnection, dst: TcpConnection) -> None:
            with contextlib.suppress(Exception):
                while True:
                    dst.send(await src.recv())

        await asyncio.gather(pump(down, up), pump(up, down))


@pytest.mark.timeout(30)
async def test_tls_relayed_handshake_is_refused(certs: Path, free_port: int) -> None:
    node_port, relay_port = free_port, free_ports(1)[0]
    relay = Relay(certs, node_port)
    listener = await relay.as_server.serve(
        "127.0.0.1",
        relay_port,
        lambda: TcpConnection(2**20, 2**20),
        on_connection=relay.accept,
        on_refused=lambda peer, why, conn: None,
        timeout=5,
    )
    async with tls_server(node_port, node_tls(certs, "trainer-0")) as server:
        conn = await open_tcp(
            "127.0.0.1",
            relay_port,
            max_frame_bytes=2**20,
            max_bulk_bytes=2**20,
            timeout=5,
            tls=node_tls(certs, "gen-0"),
        )
        with capture_logs() as logs, pytest.raises(HandshakeRefused) as refused:
            await client_handshake(conn, identity=CLIENT, secret=SECRET, session_id="s-1", timeout=5)
        conn.close()
        assert server.refusals == 1
    listener.close()
    assert refused.value.code == "auth"
    assert "relayed" in str(refused.value)
    assert any(e["event"] == "handshake.refused" and e["code"] == "auth" for e in logs)


@pytest.mark.timeout(30)
async def test_tls_plaintext_client_against_a_tls_node_is_refused(certs: Path, free_port: int) -> None:
    async with tls_server(free_port, node_tls(certs, "trainer-0")) as server:
        with capture_logs() as logs:
            session = client(free_port, None, msgspec.structs.replace(CFG, give_up_after_s=3.0))
            with pytest.raises(SessionLost) as lost:
                await session.run()
        assert server.refusals >= 1
    refused = [e for e in logs if e["event"] == "server.tls_refused"]
    assert refused and "does not speak TLS" in refused[0]["reason"], logs
    assert "accepts TLS connections only" in str(lost.value)


@pytest.mark.timeout(30)
async def test_tls_client_against_a_plaintext_node_is_refused(certs: Path, free_port: int) -> None:
    async with tls_server(free_port, None) as server:
        session = client(free_port, node_tls(certs, "gen-0"))
        with capture_logs() as logs, pytest.raises(SessionLost) as lost:
            await session.run()
        assert server.refusals == 1
    assert "does not speak TLS" in str(lost.value)
    assert any(e["event"] == "handshake.refused" and "speaks TLS" in e["reason"] for e in logs), logs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["other-ca", "expired", "someone-elses"])
async def test_tls_wrong_certificates_are_refused(
    which: str, certs: Path, free_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if which == "other-ca":
        tls = node_tls(certs / "other", "gen-0")  # it trusts another CA, and the node does not trust it
        want = "certificate is not trusted"
    elif which == "expired":
        # A node refuses to start with its own expired certificate (below); a peer that did anyway:
        monkeypatch.setattr(tls_module, "_check_certificate", lambda path: ("gen-0", b"\0" * 32))
        tls = node_tls(certs / "expired", "gen-0")
        want = "may not trust it"
    else:  # the generator presents the trainer's certificate as its own
        tls = NodeTls(certs / "ca.pem", certs / "trainer-0.pem", certs / "trainer-0.key")
        want = "certificate of node 'trainer-0'"
    quick = msgspec.structs.replace(CFG, give_up_after_s=2.0)
    async with tls_server(free_port, node_tls(certs, "trainer-0")) as server:
        session = client(free_port, tls, quick)
        with capture_logs() as logs, pytest.raises(SessionLost) as lost:
            await session.run()
    assert want in str(lost.value), (str(lost.value), logs)
    if which == "expired":  # the client cannot tell why it was dropped (asyncio loses the alert); the node's log does
        assert server.refusals >= 1
        reasons = [e["reason"] for e in logs if e["event"] == "server.tls_refused"]
        assert reasons and "certificate has expired" in reasons[0], reasons


@pytest.mark.timeout(30)
async def test_tls_a_node_may_be_only_what_the_topology_says(certs: Path, free_port: int) -> None:
    """gen-0's secret and certificate make it gen-0, a generator: not the trainer, nor a node the run lacks."""
    roles = {"trainer-0": "trainer", "gen-0": "generator"}
    async with tls_server(free_port, node_tls(certs, "trainer-0"), roles=roles) as server:
        conn = await open_tcp(
            "127.0.0.1", free_port, max_frame_bytes=2**20, max_bulk_bytes=2**20, timeout=5, tls=node_tls(certs, "gen-0")
        )
        with pytest.raises(HandshakeRefused) as refused:
            await client_handshake(
                conn, identity=Identity("gen-0", "trainer"), secret=SECRET, session_id="s", timeout=5
            )
        conn.close()
        assert refused.value.code == "identity"
        assert "is no trainer in this run's topology (it is a generator)" in refused.value.reason
        session = client(free_port, node_tls(certs, "gen-0"))  # as itself: served
        async with asyncio.TaskGroup() as tg:
            tg.create_task(session.run())
            assert await session.request(Echo(7)) == Echo(7)
            await session.close()
        assert server.refusals == 1


def test_tls_a_node_refuses_its_own_expired_certificate(certs: Path) -> None:
    with pytest.raises(ConfigError, match="not now: renew it"):
        node_tls(certs / "expired", "gen-0")


def test_tls_certs_makes_a_ca_once_and_keys_owner_only(tmp_path: Path) -> None:
    written = issue_for_nodes(tmp_path, [NodeName("a", ("10.0.0.1", "node-a.example"))])
    assert {p.name for p in written} == {"ca.pem", "ca.key", "a.pem", "a.key"}
    assert (tmp_path / "a.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "ca.key").stat().st_mode & 0o777 == 0o600
    ca = (tmp_path / "ca.pem").read_bytes()
    again = issue_for_nodes(tmp_path, [NodeName("a"), NodeName("b")])
    assert {p.name for p in again} == {"b.pem", "b.key"}
    assert (tmp_path / "ca.pem").read_bytes() == ca
    assert node_tls(tmp_path, "b").name == "b"
    assert make_ca()[0] != ca


@pytest.mark.timeout(60)
def test_tls_under_uvloop(certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests above run on asyncio's loop; nodes run uvloop, whose TLS is its own (a port of asyncio's).
    Each call below raises what its test asserts; first, that they do run on uvloop."""

    async def loop_kind() -> type:
        return type(asyncio.get_running_loop())

    assert uvloop.run(loop_kind()) is uvloop.Loop
    uvloop.run(test_tls_session_and_bulk(certs, free_ports(1)[0]))
    uvloop.run(test_tls_tamper_one_byte_drops_the_connection_and_the_session_resumes(certs, free_ports(1)[0]))
    uvloop.run(test_tls_relayed_handshake_is_refused(certs, free_ports(1)[0]))
    uvloop.run(test_tls_plaintext_client_against_a_tls_node_is_refused(certs, free_ports(1)[0]))
    uvloop.run(test_tls_client_against_a_plaintext_node_is_refused(certs, free_ports(1)[0]))
    for which in ("other-ca", "expired", "someone-elses"):
        uvloop.run(test_tls_wrong_certificates_are_refused(which, certs, free_ports(1)[0], monkeypatch))
        monkeypatch.undo()  # "expired" stands in for a node that skipped its own date check
