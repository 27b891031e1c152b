"""The protocol over real TCP on loopback, against a real server process (`echo_server.py`):
crashes and restarts mid-stream, a stopped (silent) server, handshake refusals, bulk payloads.

Every server process is started through the `echo_servers` fixture, which kills what is left of
them at teardown, whatever the test did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import struct
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Any

import pytest
from structlog.testing import capture_logs

from rollart.protocol import auth
from rollart.protocol.auth import NONCE_BYTES, Identity, client_handshake
from rollart.protocol.bulk import open_bulk, recv_blob, send_blob
from rollart.protocol.client import ClientSession, tcp_connector
from rollart.protocol.config import PROTOCOL_VERSION, SessionConfig
from rollart.protocol.errors import HandshakeRefused, SessionLost
from rollart.protocol.framing import Connection, open_tcp
from rollart.protocol.messages import CONTROL, HANDSHAKE, BlobHeader, Challenge, Echo, Hello, Proof, Refuse
from rollart.protocol.server import SessionServer
from rollart.protocol.session import Session
from rollart.workers.framing import frame

pytestmark = pytest.mark.integration

ECHO_SERVER = Path(__file__).with_name("echo_server.py")
SECRET_ENV = "ROLLART_TEST_ECHO_SECRET"
SECRET = b"integration test secret"
CFG = SessionConfig(
    heartbeat_interval_s=0.1,
    heartbeat_deadline_s=0.6,
    handshake_timeout_s=1.0,
    backoff_base_s=0.02,
    backoff_cap_s=0.1,
    give_up_after_s=20.0,
    default_request_timeout_s=20.0,
)
MAX_FRAME = CFG.max_frame_bytes


class EchoServers:
    """Starts `echo_server.py` processes on one port and kills them all at the end."""

    def __init__(self, port: int, log_dir: Path) -> None:
        self.port = port
        self.log_dir = log_dir
        self.procs: list[asyncio.subprocess.Process] = []
        self._logs: list[IO[bytes]] = []

    async def start(self, *extra: str) -> asyncio.subprocess.Process:
        log = (self.log_dir / f"echo-{len(self.procs)}.log").open("wb")
        self._logs.append(log)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ECHO_SERVER),
            "--port",
            str(self.port),
            "--secret-env",
            SECRET_ENV,
            *extra,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            env={**os.environ, SECRET_ENV: SECRET.decode()},
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        async with asyncio.timeout(15):
            line = await proc.stdout.readline()
        assert line == b"ready\n", f"echo server did not start: {line!r}; see {log.name}"
        return proc

    async def kill(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            proc.kill()  # SIGKILL: also ends a stopped process
        await proc.wait()
        assert proc.stdout is not None
        await proc.stdout.read()  # to EOF, so the pipe is closed

    async def kill_all(self) -> None:
        for proc in self.procs:
            await self.kill(proc)
        for log in self._logs:
            log.close()


@pytest.fixture
async def echo_servers(free_port: int, tmp_path: Path) -> AsyncIterator[EchoServers]:
    servers = EchoServers(free_port, tmp_path)
    try:
        yield servers
    finally:
        await servers.kill_all()


def client_for(port: int, *, secret: bytes = SECRET, name: str = "env-0") -> ClientSession:
    return ClientSession(
        lambda: tcp_connector("127.0.0.1", port, CFG),
        secret=secret,
        local=Identity(name, "env-host"),
        channel=CONTROL,
        cfg=CFG,
        peer_name="echo",
    )


async def until(condition: Callable[[], bool], timeout: float) -> None:
    """Poll a condition no event announces, for at most `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - these conditions have no event to wait on
            await asyncio.sleep(0.005)


# -- crashes -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_request_stream_survives_two_server_crashes(echo_servers: EchoServers) -> None:
    total, in_flight_max = 10_000, 64
    completed: list[int] = []
    crash_after = {3000: asyncio.Event(), 6500: asyncio.Event()}
    in_flight = asyncio.Semaphore(in_flight_max)
    proc = await echo_servers.start()
    client = client_for(echo_servers.port)

    def data(i: int) -> bytes:
        return i.to_bytes(4, "big") * (i % 7)

    async def call(i: int) -> None:
        try:
            reply = await client.request(Echo(i, data(i)))
        finally:
            in_flight.release()
        assert reply == Echo(i, data(i))
        completed.append(i)
        if (crash := crash_after.get(len(completed))) is not None:
            crash.set()

    async def crash_and_restart() -> None:
        nonlocal proc
        for crash in crash_after.values():
            await crash.wait()
            await echo_servers.kill(proc)  # SIGKILL mid-stream: requests in flight are lost with it
            proc = await echo_servers.start()

    async with asyncio.timeout(50), asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        crasher = tg.create_task(crash_and_restart())
        async with asyncio.TaskGroup() as callers:
            for i in range(total):
                await in_flight.acquire()
                callers.create_task(call(i))
        await crasher
        await client.close()

    assert len(completed) == total  # each call returned exactly once, with its own payload
    assert completed == list(range(total))  # and in the order they were sent
    assert [p.returncode for p in echo_servers.procs[:2]] == [-signal.SIGKILL, -signal.SIGKILL]
    assert client.stats.connects == 3
    assert client.stats.resent > 0  # requests were outstanding at the crashes and went to the new server


# -- a silent server ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_stopped_server_is_detected_as_silent_and_the_session_resumes(echo_servers: EchoServers) -> None:
    loop = asyncio.get_running_loop()
    proc = await echo_servers.start()
    client = client_for(echo_servers.port)
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        assert await client.request(Echo(1)) == Echo(1)
        with capture_logs() as logs:
            proc.send_signal(signal.SIGSTOP)
            stopped_at = loop.time()
            try:
                await until(lambda: client.stats.silent_peer >= 1, timeout=CFG.heartbeat_deadline_s + 1.0)
                detected_after = loop.time() - stopped_at
            finally:
                proc.send_signal(signal.SIGCONT)
            assert await client.request(Echo(2), timeout=10) == Echo(2)
        assert detected_after <= CFG.heartbeat_deadline_s + 0.5
        assert client.stats.connects >= 2
        # The server process kept the session's state: the client resumed it.
        reconnects = [entry for entry in logs if entry["event"] == "session.connected"]
        assert reconnects and all(entry["resumed"] for entry in reconnects)
        await client.close()


# -- refusals ----------------------------------------------------------------------------------


async def read_refusal(reader: asyncio.StreamReader) -> Refuse:
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    msg = HANDSHAKE.decode(await reader.readexactly(length))
    assert isinstance(msg, Refuse)
    return msg


@pytest.mark.timeout(30)
async def test_refusals_over_tcp_and_the_server_goes_on_serving(
    echo_servers: EchoServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    await echo_servers.start()
    port = echo_servers.port

    # (a) wrong secret: the session fails at once, naming the reason.
    intruder = client_for(port, secret=b"not the secret", name="intruder")
    async with asyncio.timeout(5):
        with pytest.raises(SessionLost, match=r"\(auth\).*wrong shared secret"):
            await intruder.run()

    # (b) another protocol version.
    with monkeypatch.context() as patch:
        patch.setattr(auth, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
        conn = await open_tcp("127.0.0.1", port, max_frame_bytes=MAX_FRAME, max_bulk_bytes=1 << 20, timeout=5)
        try:
            with pytest.raises(HandshakeRefused) as info:
                await client_handshake(
                    conn, identity=Identity("old-node", "env-host"), secret=SECRET, session_id="v", timeout=5
                )
        finally:
            conn.close()
    assert info.value.code == "version"
    assert f"version {PROTOCOL_VERSION + 1}" in info.value.reason
    assert f"version {PROTOCOL_VERSION}" in info.value.reason.replace(f"version {PROTOCOL_VERSION + 1}", "")

    # (c) garbage instead of a handshake: a refusal frame, then the connection is closed.
    noise = random.Random(3).randbytes(64)
    assert int.from_bytes(noise[:4], "big") > MAX_FRAME  # the noise reads as an oversized header
    not_msgpack = b"\xc1" * 60
    garbage = {
        "64 random bytes": noise,
        "a header announcing 2 GiB": struct.pack(">I", 2**31),
        "a frame that is not msgpack": struct.pack(">I", len(not_msgpack)) + not_msgpack,
    }
    for what, data in garbage.items():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            async with asyncio.timeout(5):
                refusal = await read_refusal(reader)
                assert await reader.read() == b"", f"{what}: connection left open"
        finally:
            writer.close()
            await writer.wait_closed()
        assert refusal.code == "bad-handshake", what

    # (d) the same server still serves a well-behaved client.
    client = client_for(port)
    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        tg.create_task(client.run())
        assert await client.request(Echo(3, b"still here")) == Echo(3, b"still here")
        await client.close()


@pytest.mark.timeout(30)
async def test_a_refused_client_that_goes_on_sending_reads_the_refusal_then_a_clean_end(
    echo_servers: EchoServers,
) -> None:
    """A client may send more before it sees its refusal (a request right after its proof). Were the
    server to close with those bytes unread, the peer would get a reset (seen in CI as ECONNRESET
    after the refusal): it half-closes instead and drops what still comes, until the peer hangs up."""
    await echo_servers.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", echo_servers.port)
    try:
        hello = Hello(PROTOCOL_VERSION, "env-0", "env-host", os.urandom(NONCE_BYTES), "s", "session", 0)
        writer.write(frame(HANDSHAKE.encode(hello)))
        async with asyncio.timeout(5):
            (length,) = struct.unpack(">I", await reader.readexactly(4))
            assert isinstance(HANDSHAKE.decode(await reader.readexactly(length)), Challenge)
            writer.write(frame(HANDSHAKE.encode(Proof(b"\0" * 32))))
            refusal = await read_refusal(reader)
            # After the refusal has arrived (the server has closed its side by now), keep sending.
            for _ in range(3):
                writer.write(frame(b"\x90" * 1000))
                await writer.drain()
                await asyncio.sleep(0.05)
            assert await reader.read() == b""  # an end of stream, not ConnectionResetError
    finally:
        writer.close()
        await writer.wait_closed()
    assert refusal.code == "auth"


# -- bulk ----------------------------------------------------------------------------------------


class NoRequests:
    async def on_request(self, session: Session, msg: object) -> object:
        raise NotImplementedError

    async def on_event(self, session: Session, msg: object) -> None:
        pass


@pytest.mark.timeout(30)
async def test_bulk_blob_of_16_mib_arrives_intact(free_port: int) -> None:
    size = 16 * 1024 * 1024
    payload = random.Random(4).randbytes(size)
    received: asyncio.Future[tuple[BlobHeader, bytes, Identity]] = asyncio.get_running_loop().create_future()

    async def on_bulk(conn: Connection, peer: Identity) -> None:
        header, data = await recv_blob(conn)
        received.set_result((header, bytes(data), peer))

    server = SessionServer(
        local=Identity("trainer-0", "trainer"),
        secret=SECRET,
        channel=CONTROL,
        handler=NoRequests(),
        cfg=CFG,
        on_bulk=on_bulk,
    )
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        await server.listen_tcp("127.0.0.1", free_port)
        conn = await open_bulk("127.0.0.1", free_port, local=Identity("gen-0", "generator"), secret=SECRET, cfg=CFG)
        try:
            await send_blob(conn, "weights-v7", payload, {"version": 7})
            header, data, peer = await received
        finally:
            conn.close()
        await server.close()
    assert header == BlobHeader("weights-v7", size, {"version": 7})
    assert len(data) == size
    assert data == payload
    assert peer == Identity("gen-0", "generator")


@pytest.mark.timeout(30)
async def test_a_server_cancelled_with_its_node_stops_accepting(free_port: int) -> None:
    """A node that fails cancels its server's task: a peer dialling afterwards is refused, and no
    callback of the event loop raises (the listener used to accept into the finished task group)."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    server = SessionServer(
        local=Identity("trainer-0", "trainer"), secret=SECRET, channel=CONTROL, handler=NoRequests(), cfg=CFG
    )
    serving = asyncio.ensure_future(server.serve())
    await server.listen_tcp("127.0.0.1", free_port)
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", free_port)
    await asyncio.sleep(0.1)
    assert errors == []
