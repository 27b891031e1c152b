"""The wire's errors: bad frames, lost sessions, and what a peer reports with a code (a refused
handshake, a failed handler).

Subclasses of `rollart.errors.RollartError` (the leaf module every layer may import); the only thing
of `rollart` the protocol package imports besides itself.
"""

from __future__ import annotations

from rollart.errors import DeadlineExceeded, RollartError


class ProtocolError(RollartError):
    """The peer sent something the protocol does not allow; the connection is closed."""


class FrameTooLarge(ProtocolError):
    """A frame header announced more bytes than the configured maximum."""


class MessageDecodeError(ProtocolError):
    """Bytes that are not a valid message of the expected channel."""


class UnexpectedReply(ProtocolError):
    """A peer answered a request with another message type than the request declares
    (`protocol.messages.Request`). The session goes on; only this request fails."""


class ConnectionClosed(RollartError):
    """The underlying connection is gone; a session reconnects, a raw connection cannot."""


class SessionLost(RollartError):
    """A session gave up reconnecting, or was closed, before the operation could finish."""


class RequestTimeout(DeadlineExceeded):
    """A request's deadline passed before its response arrived."""


# What a peer reports: its code (for programs) and its words.


class HandshakeRefused(RollartError):
    """The peer refused the handshake (wrong secret, wrong protocol version, ...)."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"handshake refused ({code}): {reason}")
        self.code = code
        self.reason = reason


class RemoteError(RollartError):
    """The peer's handler failed; `code` says how (e.g. `handler-error`, `bad-request`, `timeout`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
