"""What a stranger and a careless operator can get from a live node (a reward gateway, started with a
distinctive secret and admin token): a client without the secret gets a refusal and nothing else,
admin mutations need the token, the admin port listens on loopback only, and neither the secret
nor the token shows in the node's log, its admin answers or its command line.

Covered elsewhere, not repeated here: a replayed handshake and random bytes, oversized or
truncated frames and a thousand dropped connections (test_abuse.py); a wrong secret against the
session layer (test_session.py, test_protocol_tcp.py) and a weight publisher with the wrong secret
(test_weight_transfer.py); the CLI's exit status for a wrong token (test_admin_cli.py); the
default `admin_host` of the shipped topologies (test_topology.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from rollart.protocol.auth import NONCE_BYTES, _mac
from rollart.protocol.config import PROTOCOL_VERSION
from rollart.protocol.errors import SessionLost
from rollart.protocol.messages import (
    APP,
    HANDSHAKE,
    SESSION,
    Bye,
    Challenge,
    Echo,
    Hello,
    Kind,
    Msg,
    Proof,
    Refuse,
    StatusRequest,
    Welcome,
)
from rollart.topology import load_topology
from rollart.workers.framing import frame
from tests.support import healthy, http, node_client, node_env, start_node, wait_for, write_topology

pytestmark = pytest.mark.integration

SECRET = f"secret-{uuid.uuid4().hex}"
TOKEN = f"token-{uuid.uuid4().hex}"
NEEDLES = (SECRET, TOKEN, SECRET.encode().hex(), TOKEN.encode().hex())
"""What must never show: the secret and the token, as they are and in hex."""


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    port: int
    admin: int
    log: Path
    topology: Path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A reward gateway logging at debug level, with this module's secret and token."""
    folder = tmp_path_factory.mktemp("security")
    topology, ports = write_topology(
        folder,
        # env-0: this module's client, named in the topology (not started)
        {"reward": "reward-gateway", "spare": "reward-gateway", "env-0": "env-host"},
        extra_run="  log_level: debug\n  reward_pool: {min_workers: 1, max_workers: 1}\n",
    )
    port, admin = ports["reward"]
    log = folder / "reward.log"
    proc = start_node(topology, "reward", log, node_env(secret=SECRET, token=TOKEN))
    try:
        wait_for(lambda: healthy(admin), 60, "the reward gateway healthy")
        yield Node(proc, port, admin, log, topology)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]


async def conversation(port: int, *, secret: bytes | None, then: list[bytes], wait_s: float = 5.0) -> list[Any]:
    """Say Hello on a fresh connection; if `secret` is not None, prove it over the node's challenge;
    then send `then` regardless. Returns every frame the node sends, decoded, until it hangs up
    (or, once it has welcomed us, until it answers a request)."""
    hello = Hello(PROTOCOL_VERSION, "env-0", "env-host", os.urandom(NONCE_BYTES), uuid.uuid4().hex, "session", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    heard: list[Any] = []
    try:
        writer.write(frame(HANDSHAKE.encode(hello)))
        async with asyncio.timeout(wait_s):
            while True:
                try:
                    (length,) = struct.unpack(">I", await reader.readexactly(4))
                    data = await reader.readexactly(length)
                except asyncio.IncompleteReadError as exc:
                    assert exc.partial == b"", exc.partial  # hung up between frames
                    return heard
                if any(isinstance(msg, Welcome) for msg in heard):
                    heard.append(SESSION.decode(data))
                    if isinstance(heard[-1], Msg) and heard[-1].kind is Kind.RESPONSE:
                        writer.write(frame(SESSION.encode(Bye("done"))))  # the node forgets the session
                        await writer.drain()
                        return heard
                    continue
                heard.append(HANDSHAKE.decode(data))
                if isinstance(heard[-1], Challenge):
                    if secret is not None:
                        writer.write(frame(HANDSHAKE.encode(Proof(_mac(secret, b"client", hello, heard[-1])))))
                    for payload in then:
                        writer.write(frame(payload))
    finally:
        writer.close()
        with contextlib.suppress(ConnectionResetError):  # the node hung up on us first
            await writer.wait_closed()


STATUS_REQUEST = SESSION.encode(Msg(1, 0, Kind.REQUEST, corr=1, body=msgspec.Raw(APP.encode(StatusRequest()))))
"""A request for the node's status, sent as if the handshake had succeeded."""


# -- a wrong or missing secret ----------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_client_without_the_secret_gets_a_refusal_and_nothing_else(gateway: Node) -> None:
    # The right secret, for comparison: the same request is answered.
    answered = await conversation(gateway.port, secret=SECRET.encode(), then=[STATUS_REQUEST])
    assert [type(msg) for msg in answered[:2]] == [Challenge, Welcome]
    assert isinstance(answered[-1], Msg) and answered[-1].kind is Kind.RESPONSE

    _, before = http("GET", gateway.admin, "/status")
    for secret in (b"not-the-secret", b"", SECRET.encode()[:-1]):  # wrong, missing, nearly right
        heard = await conversation(gateway.port, secret=secret, then=[STATUS_REQUEST])
        assert heard[:1] == [Challenge(heard[0].nonce, "reward", "reward-gateway")]
        assert heard[1:] == [Refuse("auth", "authentication failed for node 'env-0': wrong shared secret")]
    # No proof at all: the request where the proof should be is refused, and not answered.
    heard = await conversation(gateway.port, secret=None, then=[STATUS_REQUEST])
    assert [type(msg) for msg in heard] == [Challenge, Refuse] and heard[1].code == "bad-handshake"

    # None of those became a session; the node counted them and is still up.
    _, after = http("GET", gateway.admin, "/status")
    assert len(after["sessions"]["incoming"]) == len(before["sessions"]["incoming"])
    assert gateway.proc.poll() is None


@pytest.mark.timeout(60)
async def test_msgpack_nested_too_deep_before_the_handshake_is_refused_and_the_node_stays_up(gateway: Node) -> None:
    # Found by fuzzing (tests/unit/test_messages.py): this 2 KiB Hello stopped the node.
    hello = HANDSHAKE.encode(Hello(PROTOCOL_VERSION, "x", "y", b"n", "s"))
    deep = bytes([hello[0] + 1]) + hello[1:] + b"\x91" * 2000 + b"\xc0"  # one more element, nested 2,000 deep
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(frame(deep))
    async with asyncio.timeout(5):
        answer = await reader.read(-1)
    writer.close()
    refusal = HANDSHAKE.decode(answer[4:])
    assert isinstance(refusal, Refuse) and refusal.code == "bad-handshake" and "nested too deeply" in refusal.reason
    assert gateway.proc.poll() is None and healthy(gateway.admin)
    async with asyncio.timeout(20), asyncio.TaskGroup() as tg:  # and serves a good client
        client = node_client(gateway.port, "reward", secret=SECRET.encode())
        tg.create_task(client.run())
        assert await client.request(Echo(1, b"still here"), timeout=10) == Echo(1, b"still here")
        await client.close()


# -- admin mutations need the token ------------------------------------------------------------------


def admin_post(port: int, path: str, authorization: str | None) -> tuple[int, str, dict[str, str]]:
    """POST to the admin endpoint with this Authorization header (None: none); (status, body, headers)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


NOT_THE_TOKEN = [
    None,
    "Bearer not-the-token",
    "Bearer ",
    f"Bearer {TOKEN[:-1]}",  # a prefix of it
    f"Bearer {TOKEN}x",  # it, and more
    f"Bearer  {TOKEN}",
    f"Basic {TOKEN}",
    TOKEN,
]


def state(node: Node) -> tuple[str, bool, bool]:
    _, status = http("GET", node.admin, "/status")
    return status["state"], status["paused"], status["draining"]


@pytest.mark.timeout(60)
def test_admin_mutations_without_the_token_are_refused_and_change_nothing(gateway: Node) -> None:
    # test_node.py checks no token and a wrong one on a generator; here every near miss, every route,
    # and that the node's state stays as it was, paused or not.
    for expected in (("running", False, False), ("paused", True, False)):
        assert state(gateway) == expected
        for path in ("/pause", "/resume", "/drain"):
            for authorization in NOT_THE_TOKEN:
                code, body, headers = admin_post(gateway.admin, path, authorization)
                assert code == 401, (path, authorization, code, body)
                assert headers.get("WWW-Authenticate") == 'Bearer realm="rollart"'
                assert state(gateway) == expected, (path, authorization)
            assert http("POST", gateway.admin, f"{path}?token={TOKEN}")[0] == 401  # not from the URL
        if expected[0] == "running":
            assert admin_post(gateway.admin, "/pause", f"Bearer {TOKEN}")[0] == 200
    assert admin_post(gateway.admin, "/resume", f"Bearer {TOKEN}")[0] == 200
    assert state(gateway) == ("running", False, False)
    assert gateway.proc.poll() is None  # no /drain got through


@pytest.mark.timeout(60)
def test_a_node_without_a_token_disables_mutations_and_one_without_a_secret_does_not_start(gateway: Node) -> None:
    folder = gateway.log.parent
    env = node_env(secret=SECRET, token="")
    del env["ROLLART_SECRET"]
    no_secret = start_node(gateway.topology, "spare", folder / "no-secret.log", env)
    assert no_secret.wait(timeout=30) == 2  # a configuration error: it never listens, open or not
    assert "ROLLART_SECRET" in (folder / "no-secret.log").read_text()

    admin = load_topology(gateway.topology).node("spare").admin_port
    proc = start_node(gateway.topology, "spare", folder / "spare.log", node_env(secret=SECRET, token=""))
    try:
        wait_for(lambda: healthy(admin), 60, "the node without a token healthy")
        for path in ("/pause", "/resume", "/drain"):
            for authorization in (None, "Bearer ", f"Bearer {TOKEN}"):
                code, body, _ = admin_post(admin, path, authorization)
                assert (code, "disabled" in body) == (403, True), (path, authorization, code, body)
        assert http("GET", admin, "/status")[1]["state"] == "running"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


# -- the admin port is on loopback --------------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """The local addresses of every TCP socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # each 32-bit word in the host's (little-endian) order
                found.add(socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def outward_address() -> str | None:
    """This machine's address towards the rest of the network, if it has one (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
        except OSError:
            return None
        address: str = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.timeout(30)
def test_the_admin_port_listens_on_loopback_only_unless_told_otherwise(gateway: Node) -> None:
    spec = load_topology(gateway.topology).node("reward")
    assert "admin_host" not in gateway.topology.read_text() and spec.admin_host == "127.0.0.1"
    assert listening_addresses(gateway.admin) == {"127.0.0.1"}
    if (address := outward_address()) is not None:
        with pytest.raises(OSError):  # refused: nothing listens there
            socket.create_connection((address, gateway.admin), timeout=2).close()


# -- the secret and the token never show --------------------------------------------------------------


def own_words(node: Node) -> tuple[str, str]:
    """The node's command line (what `ps` shows anyone on the machine) and its log."""
    process = Path(f"/proc/{node.proc.pid}")
    assert SECRET in (process / "environ").read_bytes().decode()  # it does hold them: the search is real
    return (process / "cmdline").read_bytes().decode(), node.log.read_text()


@pytest.mark.timeout(60)
async def test_the_secret_and_the_token_never_show_in_logs_admin_answers_or_the_command_line(gateway: Node) -> None:
    # What might make a node say them: a wrong token, a wrong secret, a good session.
    shown: list[str] = []
    for authorization in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"):
        code, body, headers = admin_post(gateway.admin, "/pause", authorization)
        shown += [str(code), body, repr(headers)]
    with capture_logs() as ours:  # what our own client sessions log, wrong secret and right
        intruder = node_client(gateway.port, "reward", secret=SECRET.encode()[::-1])
        with pytest.raises(SessionLost) as refused:
            async with asyncio.timeout(10):
                await intruder.run()
        shown.append(str(refused.value))
        async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
            client = node_client(gateway.port, "reward", secret=SECRET.encode())
            tg.create_task(client.run())
            await client.request(StatusRequest(), timeout=10)
            await client.close()
    shown.append(repr(ours))
    for path in ("/status", "/metrics", "/healthz"):
        code, body = http("GET", gateway.admin, path)
        assert code == 200
        shown.append(repr(body))
    await asyncio.sleep(0.2)  # the node's last log lines reach the file
    command_line, log = own_words(gateway)
    assert '"handshake.refused"' in log and '"admin.unauthorized"' in log  # it did log those
    shown += [command_line, log]
    for text in shown:
        for needle in NEEDLES:
            assert needle not in text, f"{needle[:12]}... shows in: {text[:200]}"


def children(pid: int) -> list[int]:
    return [
        int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()
    ]


def test_processes_a_node_starts_do_not_inherit_the_secret_or_the_token(gateway: Node) -> None:
    # Reward workers run users' reward modules: the node reads its credentials, then takes them out
    # of its environment before it starts anything (env workers drop them too: test_env_workers.py).
    workers = wait_for(lambda: children(gateway.proc.pid), 60, "the reward pool's worker started")
    for pid in workers:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        for needle in NEEDLES:
            assert needle not in environ, f"worker {pid} inherited {needle[:12]}..."
