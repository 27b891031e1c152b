"""The session channel: the session layer's own frames (`Msg`, `Ack`, `Bye`), which carry the
application's messages as opaque `msgspec.Raw` bodies; and the bodies of its errors and bulk frames.

What the session layer does with them is in `rollart.protocol.session`.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from rollart.protocol.messages.channel import WIRE as _WIRE


class Kind(enum.IntEnum):
    """What a session `Msg` is."""

    EVENT = 0
    REQUEST = 1
    RESPONSE = 2
    ERROR = 3
    CANCEL = 4


class Msg(msgspec.Struct, tag="m", **_WIRE):
    """A sequenced message: resent until acknowledged, delivered once."""

    seq: int
    ack: int
    kind: Kind
    corr: int = 0
    """Correlation id linking a request to its response, error or cancel."""
    timeout_ms: int = 0
    """A request's remaining deadline when it was sent."""
    body: msgspec.Raw = msgspec.Raw(b"\xc0")
    """The application message, encoded with the session's channel."""


class Ack(msgspec.Struct, tag="a", **_WIRE):
    """Acknowledges everything up to `ack`; also sent periodically as the heartbeat."""

    ack: int


class Bye(msgspec.Struct, tag="bye", **_WIRE):
    """The session is over (not a dropped connection): the peer forgets it."""

    reason: str


class RemoteFailure(msgspec.Struct, **_WIRE):
    """Body of an ERROR `Msg`."""

    code: str
    message: str


class BlobHeader(msgspec.Struct, tag="blob", **_WIRE):
    """Announces the bulk frame that follows it on a bulk connection."""

    name: str
    nbytes: int
    meta: dict[str, Any] = {}


SessionFrame = Msg | Ack | Bye
