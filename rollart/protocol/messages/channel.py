"""The machinery under every message: shared wire options, `Channel` (a tagged union with its
encoder and typed decoder) and `Request`, the base of a message that declares its reply.

A request names its reply type as its type argument, `class Generate(Request["Generated"], ...)`,
so `Session.request(Generate(...))` is typed `Generated` for mypy and checked at run time
(`reply_types`). The base has no fields and no tag: a request encodes to the same bytes as the
plain Struct it was (`tests/unit/test_wire_bytes.py`).
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Generic, TypeVar, get_args

import msgspec

from rollart.protocol.errors import MessageDecodeError

WIRE: dict[str, Any] = {"array_like": True, "gc": False, "omit_defaults": True, "frozen": True}
"""Options every message Struct shares: compact arrays, no GC tracking, defaults left out."""

T = TypeVar("T")
R = TypeVar("R")


class Request(msgspec.Struct, Generic[R], **WIRE):
    """A message sent with `Session.request`, answered by a message of type `R` (a union for
    several possible answers). `R` may be a string naming classes of the defining module."""


_REPLIES: dict[type, tuple[type, ...] | None] = {}


def reply_types(request_type: type) -> tuple[type, ...] | None:
    """The types a reply to `request_type` may have; None for a message that declares none."""
    try:
        return _REPLIES[request_type]  # once per request: the first lookup resolves and caches
    except KeyError:
        pass
    declared: tuple[type, ...] | None = None
    for klass in request_type.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Request and declared is None:
                (reply,) = get_args(base)
                declared = _flatten(_resolve(reply, klass))
    _REPLIES[request_type] = declared
    return declared


def _resolve(declared: Any, owner: type) -> Any:
    """`declared` with a forward reference ("Echo", "GroupTask | NoTask") evaluated in the module
    that defines `owner`, the way `typing.get_type_hints` evaluates annotations."""

    def holder() -> None: ...

    holder.__annotations__ = {"reply": declared}
    return typing.get_type_hints(holder, globalns=vars(sys.modules[owner.__module__]))["reply"]


def _flatten(declared: Any) -> tuple[type, ...]:
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        return tuple(t for arg in get_args(declared) for t in _flatten(arg))
    if not isinstance(declared, type):
        raise TypeError(f"a request's reply must be a message class or a union of them; got {declared!r}")
    return (declared,)


DECODE_ERRORS = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
"""What `Channel.decode_native` raises on bad input, with every msgspec the project allows
(`msgspec>=0.19`): besides its own `DecodeError`,
- `RecursionError`: msgspec recurses once per level of msgpack nesting, even to skip an element
  no field takes, and raises it past Python's limit: a 2 KiB frame of nested arrays would otherwise
  escape every handler that catches decode errors (one such frame from a stranger, in its
  handshake, would stop a node);
- `UnicodeDecodeError`: msgspec 0.19-0.22 raise it for invalid UTF-8 in any string (a tag, a field,
  a dict key); 0.23 raises `DecodeError("Invalid UTF-8 encoded string")`. `explain` words both
  alike. bin/test runs the fuzz tests under the lowest declared msgspec for this (gem-llm pins 0.19)."""


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

    def explain(self, exc: msgspec.DecodeError | RecursionError | UnicodeDecodeError) -> MessageDecodeError:
        """The error to raise for `exc` (one of `DECODE_ERRORS`): it names the channel and what was wrong."""
        if isinstance(exc, RecursionError):
            return MessageDecodeError(f"{self.name} channel: malformed msgpack: nested too deeply")
        if isinstance(exc, UnicodeDecodeError):  # msgspec < 0.23; the same words as 0.23's DecodeError
            return MessageDecodeError(f"{self.name} channel: malformed msgpack: Invalid UTF-8 encoded string")
        text = str(exc)
        if not isinstance(exc, msgspec.ValidationError):
            return MessageDecodeError(f"{self.name} channel: malformed msgpack: {text}")
        if text.startswith("Invalid value") and text.endswith("- at `$[0]`"):
            got = text.removeprefix("Invalid value ").removesuffix(" - at `$[0]`")
            known = ", ".join(repr(t) for t in self.tags)
            return MessageDecodeError(f"{self.name} channel: unknown message tag {got}; known: {known}")
        return MessageDecodeError(f"{self.name} channel: invalid message: {text}")
