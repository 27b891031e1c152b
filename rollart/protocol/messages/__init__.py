"""Every message on the wire: msgspec Structs grouped into one tagged union per channel.

A channel is the set of messages one stage of a connection may carry, with one typed decoder:
- `HANDSHAKE`: the frames exchanged before a session is established (`Hello` ... `Welcome`);
- `SESSION`: the session layer's own frames (`Msg`, `Ack`, `Bye`), which carry the
  application's messages as opaque `msgspec.Raw` bodies;
- `CONTROL`: the application messages every node understands (status, echo, notices);
- `APP`: everything nodes say to each other: `CONTROL` plus rollout (generation, group tasks,
  trajectories, policy versions) and reward messages.

One module per channel (`handshake`, `frames`, `control`, `rollout`); `channel` holds the shared
machinery. A request declares its reply (`Request[reply]`, see `channel`), so
`Session.request(msg)` returns the reply's type and checks it.

Schema evolution: new fields get defaults and go at the end (the structs are array-like).
"""

from __future__ import annotations

from rollart.protocol.messages.channel import DECODE_ERRORS, WIRE, Channel, Request, reply_types
from rollart.protocol.messages.control import ControlMsg, Echo, NodeStatus, Notice, StatusRequest
from rollart.protocol.messages.frames import Ack, BlobHeader, Bye, Kind, Msg, RemoteFailure, SessionFrame
from rollart.protocol.messages.handshake import Challenge, HandshakeMsg, Hello, Proof, Refuse, Welcome
from rollart.protocol.messages.rollout import (
    Generate,
    Generated,
    GroupAck,
    GroupDone,
    GroupFailed,
    GroupTask,
    NoTask,
    PolicyVersion,
    RewardMsg,
    RolloutMsg,
    Score,
    Scored,
    SimWeights,
    TaskWanted,
    Trajectory,
    WeightsHere,
    WeightsWhere,
)

AppMsg = ControlMsg | RolloutMsg | RewardMsg

HANDSHAKE: Channel[HandshakeMsg] = Channel("handshake", HandshakeMsg)
SESSION: Channel[SessionFrame] = Channel("session", SessionFrame)
CONTROL: Channel[ControlMsg] = Channel("control", ControlMsg)
APP: Channel[AppMsg] = Channel("app", AppMsg)
"""What nodes say to each other; each role serves the messages that concern it."""
REMOTE_FAILURE: Channel[RemoteFailure] = Channel("remote-failure", RemoteFailure)
BLOB: Channel[BlobHeader] = Channel("blob", BlobHeader)

__all__ = [
    "APP",
    "BLOB",
    "CONTROL",
    "DECODE_ERRORS",
    "HANDSHAKE",
    "REMOTE_FAILURE",
    "SESSION",
    "WIRE",
    "Ack",
    "AppMsg",
    "BlobHeader",
    "Bye",
    "Challenge",
    "Channel",
    "ControlMsg",
    "Echo",
    "Generate",
    "Generated",
    "GroupAck",
    "GroupDone",
    "GroupFailed",
    "GroupTask",
    "HandshakeMsg",
    "Hello",
    "Kind",
    "Msg",
    "NoTask",
    "NodeStatus",
    "Notice",
    "PolicyVersion",
    "Proof",
    "Refuse",
    "RemoteFailure",
    "Request",
    "RewardMsg",
    "RolloutMsg",
    "Score",
    "Scored",
    "SessionFrame",
    "SimWeights",
    "StatusRequest",
    "TaskWanted",
    "Trajectory",
    "WeightsHere",
    "WeightsWhere",
    "Welcome",
    "reply_types",
]
