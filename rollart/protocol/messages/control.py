"""The control channel: the application messages every node understands (status, echo, notices).

`StatusRequest` and `Echo` are requests (`Request[reply]`); `Notice` is a one-way event.
"""

from __future__ import annotations

import msgspec

from rollart.protocol.messages.channel import WIRE as _WIRE
from rollart.protocol.messages.channel import Request


class StatusRequest(Request["NodeStatus"], tag="status?", **_WIRE):
    """Ask a node for its status."""


class NodeStatus(msgspec.Struct, tag="status", **_WIRE):
    """A node's status as peers see it (the admin HTTP `/status` has more)."""

    node: str
    role: str
    uptime_s: float
    paused: bool
    draining: bool
    load: dict[str, float] = {}
    """Role-specific gauges peers may use (a generator: busy_s, engine_up_s, version)."""


class Echo(Request["Echo"], tag="echo", **_WIRE):
    """Echoed back as-is: liveness checks, tests and benchmarks."""

    n: int
    data: bytes = b""


class Notice(msgspec.Struct, tag="notice", **_WIRE):
    """A one-way event for people: something a peer should log."""

    text: str


ControlMsg = StatusRequest | NodeStatus | Echo | Notice
