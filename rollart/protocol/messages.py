"""Every message on the wire: msgspec Structs grouped into one tagged union per channel.

A channel is the set of messages one stage of a connection may carry, with one typed decoder:
- `HANDSHAKE`: the frames exchanged before a session is established (`Hello` ... `Welcome`);
- `SESSION`: the session layer's own frames (`Msg`, `Ack`, `Bye`), which carry the
  application's messages as opaque `msgspec.Raw` bodies;
- `CONTROL`: the application messages every node understands (status, echo, notices);
- `APP`: everything nodes say to each other: `CONTROL` plus rollout (generation, group tasks,
  trajectories, policy versions) and reward messages.

Schema evolution: new fields get defaults and go at the end (the structs are array-like).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Generic, TypeVar, get_args

import msgspec

from rollart.protocol.errors import MessageDecodeError

_WIRE = {"array_like": True, "gc": False, "omit_defaults": True, "frozen": True}


# -- handshake channel -------------------------------------------------------------------------


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


# -- session channel ----------------------------------------------------------------------------


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


# -- control channel ----------------------------------------------------------------------------


class StatusRequest(msgspec.Struct, tag="status?", **_WIRE):
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


class Echo(msgspec.Struct, tag="echo", **_WIRE):
    """Echoed back as-is: liveness checks, tests and benchmarks."""

    n: int
    data: bytes = b""


class Notice(msgspec.Struct, tag="notice", **_WIRE):
    """A one-way event for people: something a peer should log."""

    text: str


ControlMsg = StatusRequest | NodeStatus | Echo | Notice


# -- rollout channel: generation, group tasks, trajectories, rewards --------------------------


class Generate(msgspec.Struct, tag="gen", **_WIRE):
    """Env-host -> generator: generate one turn of one trajectory."""

    request_id: str
    trajectory_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = []
    seed: int | None = None
    min_version: int = 0
    """Serve with weights of this version or newer (the trainer's version minus alpha): a generator
    still on older weights waits for the push (within the request's deadline)."""


class Generated(msgspec.Struct, tag="generated", **_WIRE):
    """Generator -> env-host: the turn's tokens, their behaviour log-probs and weight versions."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int
    generator: str


class TaskWanted(msgspec.Struct, tag="task?", **_WIRE):
    """Env-host -> trainer: a slot is free; give it a group (the trainer may wait, then say no)."""

    env_host: str
    wait_s: float = 5.0


class GroupTask(msgspec.Struct, tag="group-task", **_WIRE):
    """Trainer -> env-host: run G + R trajectories of `task` on environment seed `seed`."""

    group_id: str
    task: str
    seed: int
    group_size: int
    redundancy: int
    version: int
    """The trainer's policy version when the group was granted."""


class NoTask(msgspec.Struct, tag="no-task", **_WIRE):
    """Trainer -> env-host: nothing to run now (alpha admission, paused, or the run is done)."""

    reason: str
    done: bool = False


class Trajectory(msgspec.Struct, tag="trajectory", **_WIRE):
    """One finished trajectory, token by token.

    `response_ids` holds everything after the first prompt: generated tokens and the later
    observations; `response_mask` is 1 exactly on generated tokens, and `logprobs` / `versions`
    hold their behaviour log-prob and weight version (0.0 / -1 elsewhere).
    """

    trajectory_id: str
    group_id: str
    task: str
    seed: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    env_reward: float
    turns: int
    finish: str
    """done (the environment ended it), max-turns or max-tokens."""
    started_at_version: int
    """The trainer's policy version when the trajectory made its first generation call."""
    started_at: float
    finished_at: float
    env_wait_s: float
    gen_wait_s: float
    generators: list[str] = []
    success: bool = False
    """The environment said the episode was solved (`info["success"]`)."""
    spans: list[tuple[str, float, float]] = []
    """(kind, start, end) wall-clock times of each env call ("env"), generation ("gen") and the
    reward ("reward"): what the run report's trajectory timeline draws."""
    segments: list[int] = []
    """Offsets in `response_ids` where a new, independent sequence starts (a task with
    `context: last` gives each turn a fresh prompt: the prompt's ids, then the reply). Empty: the
    whole trajectory is one sequence."""


class GroupDone(msgspec.Struct, tag="group", **_WIRE):
    """Env-host -> trainer: the first G finished trajectories of a group."""

    group_id: str
    trajectories: list[Trajectory]
    cancelled: int = 0
    failed: int = 0


class GroupFailed(msgspec.Struct, tag="group-failed", **_WIRE):
    """Env-host -> trainer: the group cannot reach G; re-issue it."""

    group_id: str
    reason: str


class GroupAck(msgspec.Struct, tag="group-ack", **_WIRE):
    """Trainer -> env-host: whether the group was taken into the SampleBuffer."""

    accepted: bool
    reason: str = ""


class PolicyVersion(msgspec.Struct, tag="version", **_WIRE):
    """Trainer -> env-hosts: the policy is at `version`; abort what started before `min_start`."""

    version: int
    min_start: int
    done: bool = False
    """The run is over: abort everything in flight and ask for no more work."""


class Score(msgspec.Struct, tag="score", **_WIRE):
    """Env-host -> reward gateway: score one trajectory with reward function `fn`."""

    fn: str
    task: str
    prompt: str
    response: str
    answer: str | None = None
    env_reward: float | None = None
    tokens: int = 0
    """The trajectory's prompt and response tokens (what a simulated reward model's time follows)."""


class Scored(msgspec.Struct, tag="scored", **_WIRE):
    """Reward gateway -> env-host: the reward and what the function reported."""

    reward: float
    details: dict[str, Any] = {}


class WeightsWhere(msgspec.Struct, tag="weights?", **_WIRE):
    """Trainer -> generator: where and how do I push you weights?"""


class WeightsHere(msgspec.Struct, tag="weights", **_WIRE):
    """Generator -> trainer: the version it holds, and its UCX receiver's port (0: TCP bulk only,
    to the session port)."""

    version: int
    ucx_port: int = 0


class SimWeights(msgspec.Struct, tag="sim-weights", **_WIRE):
    """Trainer -> generator, simulation mode: policy `version` reaches the engine `after_s` simulated
    seconds from now, and loading it stops generation for `pause_s`. Answered (with itself) once loaded."""

    version: int
    after_s: float
    pause_s: float


RolloutMsg = (
    Generate
    | Generated
    | TaskWanted
    | GroupTask
    | NoTask
    | GroupDone
    | GroupFailed
    | GroupAck
    | PolicyVersion
    | WeightsWhere
    | WeightsHere
    | SimWeights
)
RewardMsg = Score | Scored
AppMsg = ControlMsg | RolloutMsg | RewardMsg


# -- channels -----------------------------------------------------------------------------------

T = TypeVar("T")

DECODE_ERRORS = (msgspec.DecodeError, RecursionError)
"""What `Channel.decode_native` raises on bad input. msgspec recurses once per level of msgpack
nesting, even to skip an element no field takes, and raises `RecursionError` past Python's limit:
a 2 KiB frame of nested arrays would otherwise escape every handler that catches decode errors
(one such frame from a stranger, in its handshake, would stop a node)."""


class Channel(Generic[T]):
    """One tagged union of messages with its encoder and typed decoder.

    `decode` rejects unknown tags, wrong types and trailing bytes with a `MessageDecodeError`
    that names the channel and says what was wrong.
    """

    def __init__(self, name: str, union: Any) -> None:
        self.name = name
        self.types: tuple[type[msgspec.Struct], ...] = get_args(union) or (union,)
        self.tags = [msgspec.inspect.type_info(t).tag for t in self.types]  # type: ignore[attr-defined]
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)
        # Bound methods, not wrappers: these run once per message on both ends of every session.
        self.encode: Callable[[T], bytes] = msgspec.msgpack.Encoder().encode
        self.decode_native: Callable[[bytes | memoryview], T] = self._decoder.decode
        """Decode raising msgspec's own errors (`DECODE_ERRORS`); hot paths catch them and call `explain`."""

    def decode(self, data: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except DECODE_ERRORS as exc:
            raise self.explain(exc) from None

    def explain(self, exc: msgspec.DecodeError | RecursionError) -> MessageDecodeError:
        """The error to raise for `exc` (one of `DECODE_ERRORS`): it names the channel and what was wrong."""
        if isinstance(exc, RecursionError):
            return MessageDecodeError(f"{self.name} channel: malformed msgpack: nested too deeply")
        text = str(exc)
        if not isinstance(exc, msgspec.ValidationError):
            return MessageDecodeError(f"{self.name} channel: malformed msgpack: {text}")
        if text.startswith("Invalid value") and text.endswith("- at `$[0]`"):
            got = text.removeprefix("Invalid value ").removesuffix(" - at `$[0]`")
            known = ", ".join(repr(t) for t in self.tags)
            return MessageDecodeError(f"{self.name} channel: unknown message tag {got}; known: {known}")
        return MessageDecodeError(f"{self.name} channel: invalid message: {text}")


HANDSHAKE: Channel[HandshakeMsg] = Channel("handshake", HandshakeMsg)
SESSION: Channel[SessionFrame] = Channel("session", SessionFrame)
CONTROL: Channel[ControlMsg] = Channel("control", ControlMsg)
APP: Channel[AppMsg] = Channel("app", AppMsg)
"""What nodes say to each other; each role serves the messages that concern it."""
REMOTE_FAILURE: Channel[RemoteFailure] = Channel("remote-failure", RemoteFailure)
BLOB: Channel[BlobHeader] = Channel("blob", BlobHeader)
