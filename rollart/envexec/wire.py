"""What an env-host and its env worker processes say to each other (`rollart.envexec.pool`, `.worker`).

One socket pair per worker; each message is a frame of `rollart.workers.framing` (a 4-byte
big-endian length, then the payload, as the protocol's message frames), its payload a
msgpack-encoded struct of the tagged unions below (array-like: a list, its tag first). Every call carries a
call id, unique in the pool, that its reply repeats; `env` is the id the pool gave the env.

    pool -> worker   Make(call, env, name, kwargs)          build `make_env(name, **kwargs)` there
                     Reset(call, env, seed) / Step(call, env, action) / Close(call, env)
    worker -> pool   Ready(pid, user_envs)                  once the env modules are imported
                     StartFailed(reason)                    instead, and the worker exits
                     Made / ResetDone / StepDone / Closed   a call's result
                     Failed(call, error)                    the call raised; `error` says what

Replies come from code the env-host does not trust, so they are msgpack decoded into these
types, never pickled, and a frame longer than `MAX_REPLY_BYTES` ends the worker. Each direction has
its own decoder of its own union; a reply of the wrong kind for its call (`ANSWERS`) fails that call
with `WorkerReplyError`, never an assertion. Every reply
carries `cpu_s`, the worker's CPU seconds so far, which the pool uses to retire workers before
their CPU limit (see the pool's docstring).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from rollart.envs.base import EnvFailure

MAX_REPLY_BYTES = 64 * 2**20
"""The longest reply the pool reads from a worker; a longer one is a broken (or hostile) worker."""

_TAGGED = {"array_like": True, "gc": False, "omit_defaults": True, "frozen": True}


class _EnvCall(msgspec.Struct, **_TAGGED):
    """What every call to an env starts with (the fields below follow these)."""

    call: int
    """Unique in the pool; the reply repeats it."""
    env: int
    """The id the pool gave the env."""


class Make(_EnvCall, tag="make"):
    name: str
    kwargs: dict[str, Any] = {}


class Reset(_EnvCall, tag="reset"):
    seed: int | None = None


class Step(_EnvCall, tag="step"):
    action: str


class Close(_EnvCall, tag="close"):
    """`env.close()`; the worker then forgets the env."""


Request = Make | Reset | Step | Close


class Ready(msgspec.Struct, tag="ready", **_TAGGED):
    pid: int
    user_envs: list[str] = []
    """Env names and family prefixes (`gem:`) that the env modules registered or replaced."""


class StartFailed(msgspec.Struct, tag="start-failed", **_TAGGED):
    reason: str


class _CallReply(msgspec.Struct, **_TAGGED):
    """What every reply to a call starts with; each ends with `cpu_s`, the worker's CPU seconds so far."""

    call: int
    """The call it answers."""


class Made(_CallReply, tag="made"):
    profile: str
    max_turns: int
    system_prompt: str
    cpu_s: float = 0.0


class ResetDone(_CallReply, tag="reset-done"):
    obs: str
    info: dict[str, Any]
    wait_s: float = 0.0
    cpu_s: float = 0.0


class StepDone(_CallReply, tag="step-done"):
    obs: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    wait_s: float = 0.0
    cpu_s: float = 0.0


class Closed(_CallReply, tag="closed"):
    cpu_s: float = 0.0


class Failed(_CallReply, tag="failed"):
    error: str
    """`{exception type}: {message}`, with the limit it hit when it was one."""
    cpu_s: float = 0.0


Reply = Ready | StartFailed | Made | ResetDone | StepDone | Closed | Failed
CallReply = Made | ResetDone | StepDone | Closed | Failed


ANSWERS: dict[str, type[Made | ResetDone | StepDone | Closed]] = {
    "make": Made,
    "reset": ResetDone,
    "step": StepDone,
    "close": Closed,
}
"""The reply each call (by its op) is answered with, unless it failed (`Failed`)."""


class WorkerReplyError(EnvFailure):
    """An env worker answered a call with a reply of the wrong kind (a broken or hostile worker):
    it fails that call, naming the worker and what it sent; the pool and the worker go on."""


OPS = {answer: op for op, answer in ANSWERS.items()}
"""The op (`"reset"`) whose answer a reply type is."""

Answer = TypeVar("Answer", Made, ResetDone, StepDone, Closed)
"""The reply a call expects (`submit` is typed by it)."""


def tag_of(reply: Reply | type[Reply]) -> str:
    """A reply's (or reply type's) wire tag (`"step-done"`), for messages about it."""
    kind = reply if isinstance(reply, type) else type(reply)
    return str(kind.__struct_config__.tag)


def _plain(value: Any) -> Any:
    """What msgpack cannot carry in an info dict: numpy scalars and arrays as Python numbers and
    lists, anything else as its `str` (the info is for logs and rewards, not for round trips)."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = msgspec.msgpack.Encoder(enc_hook=_plain)
reply_decoder = msgspec.msgpack.Decoder(Reply)
