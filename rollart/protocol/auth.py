"""The handshake: protocol version, identities, and mutual HMAC challenge-response.

    client                                  server
      Hello(version, node, role, nonce_c, session_id, purpose, recv_seq)  ->
                                           <-  Challenge(nonce_s, node, role)   | Refuse
      Proof(HMAC(secret, client|Hello|Challenge))  ->
                                 <-  Welcome(HMAC(secret, server|Hello|Challenge|Welcome), epoch, ...) | Refuse

Both nonces are fresh per connection, so a recorded proof is useless on another connection (no
replay). The server proves it knows the secret too, so a client never talks to an impostor. Each
proof covers the whole handshake so far, every field of every frame (the Welcome's own fields too,
its MAC left blank), as msgspec encodes them, which is canonical: the side that checks re-encodes
what it decoded, so a field changed on the way (a Hello's `recv_seq`, a Welcome's `epoch`) fails
the proof.
A refusal is sent as a `Refuse` frame, logged on both sides, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import structlog

from rollart.errors import RollartError
from rollart.protocol.config import PROTOCOL_VERSION
from rollart.protocol.errors import HandshakeRefused, MessageDecodeError, ProtocolError
from rollart.protocol.framing import Connection
from rollart.protocol.messages import HANDSHAKE, Challenge, Hello, Proof, Refuse, Welcome

log = structlog.get_logger("rollart.protocol.auth")

NONCE_BYTES = 32


@dataclass(frozen=True)
class Identity:
    """Who a node is on the wire."""

    node: str
    role: str


def _mac(
    secret: bytes,
    side: bytes,
    hello: Hello,
    challenge: Challenge,
    welcome: Welcome | None = None,
    *,
    binding: bytes = b"",
) -> bytes:
    """HMAC over the handshake's transcript: the TLS channel binding (`TlsPeer.binding`: 64 bytes, or
    none without TLS), the Hello and the Challenge as encoded (msgpack frames delimit themselves, so the
    concatenation is unambiguous), and for the server's proof the Welcome with its MAC blank."""
    transcript = binding + HANDSHAKE.encode(hello) + HANDSHAKE.encode(challenge)
    if welcome is not None:
        transcript += HANDSHAKE.encode(msgspec.structs.replace(welcome, mac=b""))
    return hmac.new(secret, b"rollart|" + side + b"|" + transcript, hashlib.sha256).digest()


def _binding(conn: Connection) -> bytes:
    return conn.tls.binding if conn.tls is not None else b""


M = TypeVar("M", Hello, Challenge, Proof, Welcome)


async def _recv(conn: Connection, expected: type[M]) -> M:
    """The peer's next handshake frame, which must be an `expected`: checked here, explicitly (an
    `assert` would vanish under `python -O`), as everything a peer sends must be."""
    msg = HANDSHAKE.decode(await conn.recv())
    if isinstance(msg, Refuse):
        raise HandshakeRefused(msg.code, msg.reason)
    if not isinstance(msg, expected):
        raise ProtocolError(f"handshake: expected {expected.__name__}; got {type(msg).__name__}")
    return msg


async def client_handshake(
    conn: Connection,
    *,
    identity: Identity,
    secret: bytes,
    session_id: str,
    recv_seq: int = 0,
    purpose: str = "session",
    timeout: float,
) -> tuple[Welcome, Identity]:
    """Run the client side; returns the server's `Welcome` and identity, or raises.

    Raises `HandshakeRefused` when the server refuses, `ProtocolError` when it misbehaves
    (including failing to prove it knows the secret), `TimeoutError` past `timeout`.
    """
    nonce = os.urandom(NONCE_BYTES)
    hello = Hello(PROTOCOL_VERSION, identity.node, identity.role, nonce, session_id, purpose, recv_seq)
    async with asyncio.timeout(timeout):
        conn.send(HANDSHAKE.encode(hello))
        challenge = await _recv(conn, Challenge)
        conn.send(HANDSHAKE.encode(Proof(_mac(secret, b"client", hello, challenge, binding=_binding(conn)))))
        welcome = await _recv(conn, Welcome)
    if not hmac.compare_digest(welcome.mac, _mac(secret, b"server", hello, challenge, welcome, binding=_binding(conn))):
        log.error("handshake.server_unproven", peer=conn.peer, server=challenge.node)
        relayed = " (or the handshake was relayed: the TLS certificates differ)" if conn.tls else ""
        raise ProtocolError(
            f"server {challenge.node} at {conn.peer} failed to prove it knows the shared secret{relayed}"
        )
    if conn.tls is not None and conn.tls.name != challenge.node:
        raise ProtocolError(
            f"server at {conn.peer} says it is node {challenge.node!r}; its certificate is {conn.tls.name!r}'s"
        )
    return welcome, Identity(challenge.node, challenge.role)


SessionLookup = Callable[[Hello], tuple[str, bool, int]]
"""Given an authenticated Hello, returns (epoch, resumed, recv_seq) for the Welcome, or raises
`HandshakeRefused`, which the peer is told."""


def _secret_for(
    hello: Hello, secret: bytes | Callable[[Hello], bytes], refuse: Callable[[str, str], HandshakeRefused]
) -> bytes:
    if not callable(secret):
        return secret
    try:
        return secret(hello)
    except HandshakeRefused as exc:  # a client it does not know
        raise refuse(exc.code, exc.reason) from None


async def server_handshake(
    conn: Connection,
    *,
    identity: Identity,
    secret: bytes | Callable[[Hello], bytes],
    lookup: SessionLookup,
    timeout: float,
) -> Hello:
    """Run the server side; returns the client's authenticated `Hello`, or refuses and raises.

    `secret`: the shared secret, or a function giving the one the client must prove from its
    `Hello` (a shared reward gateway knows each run by its own) that raises `HandshakeRefused` for
    a client it does not know.

    On refusal the peer gets a `Refuse` frame saying why, the refusal is logged, and
    `HandshakeRefused` is raised so the caller closes the connection.
    """

    def refuse(code: str, reason: str) -> HandshakeRefused:
        log.warning("handshake.refused", peer=conn.peer, code=code, reason=reason)
        # The connection may already be unusable; the refusal is logged either way.
        with contextlib.suppress(RollartError):
            conn.send(HANDSHAKE.encode(Refuse(code, reason)))
        return HandshakeRefused(code, reason)

    try:
        async with asyncio.timeout(timeout):
            hello = await _recv(conn, Hello)
            if hello.version != PROTOCOL_VERSION:
                raise refuse(
                    "version",
                    f"client {hello.node!r} speaks protocol version {hello.version}; "
                    f"this server ({identity.node}) speaks version {PROTOCOL_VERSION}",
                )
            if hello.purpose not in ("session", "bulk"):
                raise refuse("bad-handshake", f"unknown connection purpose {hello.purpose!r}")
            key = _secret_for(hello, secret, refuse)
            challenge = Challenge(os.urandom(NONCE_BYTES), identity.node, identity.role)
            conn.send(HANDSHAKE.encode(challenge))
            proof = await _recv(conn, Proof)
    except TimeoutError:
        raise refuse("timeout", f"handshake not finished within {timeout} s") from None
    except MessageDecodeError as exc:
        raise refuse("bad-handshake", f"expected a handshake frame: {exc}") from None
    except ProtocolError as exc:  # includes FrameTooLarge
        raise refuse("bad-handshake", str(exc)) from None
    if not hmac.compare_digest(proof.mac, _mac(key, b"client", hello, challenge, binding=_binding(conn))):
        relayed = ", or the handshake was relayed (the TLS certificates differ)" if conn.tls else ""
        raise refuse("auth", f"authentication failed for node {hello.node!r}: wrong shared secret{relayed}")
    if conn.tls is not None and conn.tls.name != hello.node.rpartition("/")[2]:  # "job/node": a job's node
        raise refuse("identity", f"node {hello.node!r} presented the certificate of node {conn.tls.name!r}")
    try:
        epoch, resumed, recv_seq = lookup(hello)
    except HandshakeRefused as exc:  # the server will not have this peer (`SessionServer(roles=...)`)
        raise refuse(exc.code, exc.reason) from None
    welcome = Welcome(b"", epoch, resumed, recv_seq)
    welcome = msgspec.structs.replace(
        welcome, mac=_mac(key, b"server", hello, challenge, welcome, binding=_binding(conn))
    )
    conn.send(HANDSHAKE.encode(welcome))
    return hello
