"""The handshake channel: the frames exchanged before a session is established (`Hello` ... `Welcome`).

The exchange itself, and what each side checks, is in `rollart.protocol.auth`.
"""

from __future__ import annotations

import msgspec

from rollart.protocol.messages.channel import WIRE as _WIRE


class Hello(msgspec.Struct, tag="hello", **_WIRE):
    """Client -> server: who I am, which session I want, and my challenge to the server."""

    version: int
    node: str
    role: str
    nonce: bytes
    session_id: str
    purpose: str = "session"
    """`session` for a persistent message session, `bulk` for a raw bulk-payload connection."""
    recv_seq: int = 0
    """Highest contiguous sequence number the client has received in this session."""


class Challenge(msgspec.Struct, tag="challenge", **_WIRE):
    """Server -> client: the server's nonce, which the client must sign with the shared secret."""

    nonce: bytes
    node: str
    role: str


class Proof(msgspec.Struct, tag="proof", **_WIRE):
    """Client -> server: HMAC over both nonces and the identities."""

    mac: bytes


class Welcome(msgspec.Struct, tag="welcome", **_WIRE):
    """Server -> client: accepted; the server proves it knows the secret too."""

    mac: bytes
    epoch: str
    """Random id of the server process: a new one means the server lost all session state."""
    resumed: bool
    """The server still had this session's state (a reconnect, not a new session)."""
    recv_seq: int
    """Highest contiguous sequence number the server has received in this session."""


class Refuse(msgspec.Struct, tag="refuse", **_WIRE):
    """Either side: the handshake is refused; `code` is machine-readable, `reason` is for people."""

    code: str
    reason: str


HandshakeMsg = Hello | Challenge | Proof | Welcome | Refuse
