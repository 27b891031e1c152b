"""Re-export of the exception hierarchy (defined with the wire, the lowest layer)."""

from rollart.protocol.errors import (
    ConfigError,
    ConnectionClosed,
    FrameTooLarge,
    HandshakeRefused,
    MessageDecodeError,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    RollartError,
    SessionLost,
)

__all__ = [
    "ConfigError",
    "ConnectionClosed",
    "FrameTooLarge",
    "HandshakeRefused",
    "MessageDecodeError",
    "ProtocolError",
    "RemoteError",
    "RequestTimeout",
    "RollartError",
    "SessionLost",
]
