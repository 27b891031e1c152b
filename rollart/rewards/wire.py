"""What the reward pool and its reward worker processes say to each other (`rollart.rewards.pool`, `.worker`).

One socket pair per worker; each message is a frame of `rollart.workers.framing` (a 4-byte
big-endian length, then the payload), its payload a msgpack-encoded struct of the tagged unions
below (array-like: a list, its tag first). One job at a time:

    worker -> pool   Ready(pid)                         its preload imports are done (ends the cold start)
                     StartFailed(reason)                instead, if one failed; the worker exits
    pool -> worker   Job(req_id, name, fn, item)        score `item` with the function `fn` names
    worker -> pool   Done(req_id, output, cpu_s)        the function's `ScoreOutput`
                     Failed(req_id, message, cpu_s)     it raised, could not be imported, or returned something invalid
    pool -> worker   Stop()                             finish and exit (idle retirement, the pool closing)

The function is named, never pickled: `fn` is its `module:qualname` (`rollart.rewards.base.reference`),
which the worker imports, so a function registered after the worker started, or from a module only
the gateway imported so far, resolves there. Replies come from users' code, so they are decoded into
these types by one typed decoder and never unpickled; a frame longer than `MAX_REPLY_BYTES`, bytes
that are not a reply, or a reply that is not the one due (another job's, a second `Ready`) fail the
job and end the worker. `cpu_s` is the worker's CPU seconds so far; the pool retires a worker past
half its CPU limit.
"""

from __future__ import annotations

import msgspec

from rollart.rewards.base import ScoreInput, ScoreOutput

MAX_REPLY_BYTES = 16 * 2**20
"""The longest reply the pool reads from a worker; a longer one is a broken (or hostile) worker."""

_TAGGED = {"array_like": True, "gc": False, "omit_defaults": True, "frozen": True}


class Job(msgspec.Struct, tag="job", **_TAGGED):
    req_id: int
    """Unique in the pool; its reply repeats it."""
    name: str
    """The name the function is registered by (for messages)."""
    fn: str
    """The function as `module:qualname`, imported by the worker."""
    item: ScoreInput


class Stop(msgspec.Struct, tag="stop", **_TAGGED):
    """Exit now (sent to an idle worker only)."""


Request = Job | Stop


class Ready(msgspec.Struct, tag="ready", **_TAGGED):
    pid: int


class StartFailed(msgspec.Struct, tag="start-failed", **_TAGGED):
    reason: str


class Done(msgspec.Struct, tag="done", **_TAGGED):
    req_id: int
    output: ScoreOutput
    cpu_s: float = 0.0


class Failed(msgspec.Struct, tag="failed", **_TAGGED):
    req_id: int
    message: str
    """What the caller's `RewardError` says: the function's own message, or what went wrong."""
    cpu_s: float = 0.0


Reply = Ready | StartFailed | Done | Failed


def tag_of(reply: Reply) -> str:
    """A reply's wire tag (`"done"`), for messages about it."""
    return str(type(reply).__struct_config__.tag)


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(Reply)
