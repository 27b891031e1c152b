"""Hypothesis strategies for what crosses the wire, and the one property every decoder must keep.

- `values_of(T)`: any value of a message type, read from the type itself (`msgspec.inspect`), so a
  new message or field is fuzzed without a change here (an unknown kind of field fails loudly);
- `msgpack_trees`, `tagged_trees(channel)`: valid msgpack of any shape, and arrays that start with
  one of a channel's tags (they get past the tag and reach the fields' validation);
- `mutations(data)`: valid bytes with bits flipped, bytes replaced, cut short, cut out or inserted;
- `check_decode(channel, data)`: the bytes decode to a message of the channel, or the channel raises
  its documented `MessageDecodeError`, never anything else.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from rollart.protocol.errors import MessageDecodeError
from rollart.protocol.messages import Channel

FUZZ_EXAMPLES = 100
"""Examples per fuzz test (and per channel of a test run for each): ~20 s for every fuzz test of
the default run on a 2-core machine under load."""

MSGPACK_INTS = st.integers(-(2**63), 2**64 - 1)
"""Every integer msgpack can carry."""

scalars = st.one_of(st.none(), st.booleans(), MSGPACK_INTS, st.floats(), st.text(max_size=12), st.binary(max_size=12))
msgpack_trees: SearchStrategy[Any] = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 5)), children, max_size=4),
    ),
    max_leaves=12,
)


def tagged_trees(channel: Channel[Any]) -> SearchStrategy[list[Any]]:
    """Arrays as the channel's array-like structs are encoded: a known tag (for an untagged struct,
    nothing), then values of any shape."""
    tags = [tag for tag in channel.tags if tag is not None]
    head = st.sampled_from(tags).map(lambda tag: [tag]) if tags else st.just([])
    return st.tuples(head, st.lists(msgpack_trees, max_size=8)).map(lambda parts: parts[0] + parts[1])


def _ints(t: msgspec.inspect.IntType) -> SearchStrategy[int]:
    low = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
    high = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**64 - 1)
    return st.integers(low, high)


def values_of(t: Any) -> SearchStrategy[Any]:
    """Any value of `t` (a Python type, or a `msgspec.inspect.Type`) that msgpack can carry."""
    mi = msgspec.inspect
    if not isinstance(t, mi.Type):
        t = mi.type_info(t)
    match t:
        case mi.IntType():
            return _ints(t)
        case mi.FloatType():
            return st.floats()
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.StrType():
            return st.text(max_size=24)
        case mi.BytesType():
            return st.binary(max_size=40)
        case mi.AnyType():
            return msgpack_trees
        case mi.RawType():
            return msgpack_trees.map(lambda value: msgspec.Raw(msgspec.msgpack.encode(value)))
        case mi.EnumType():
            return st.sampled_from(list(t.cls))
        case mi.ListType():
            return st.lists(values_of(t.item_type), max_size=3)
        case mi.VarTupleType():
            return st.lists(values_of(t.item_type), max_size=3).map(tuple)
        case mi.TupleType():
            return st.tuples(*(values_of(item) for item in t.item_types))
        case mi.DictType():
            return st.dictionaries(values_of(t.key_type), values_of(t.value_type), max_size=3)
        case mi.UnionType():
            return st.one_of(*(values_of(member) for member in t.types))
        case mi.StructType():
            fields = {field.name: values_of(field.type) for field in t.fields if field.required}
            optional = {field.name: values_of(field.type) for field in t.fields if not field.required}
            return st.fixed_dictionaries(fields, optional=optional).map(lambda kwargs: t.cls(**kwargs))
    raise TypeError(f"no strategy for {t!r}: teach tests/strategies.py this kind of field")


def messages_of(channel: Channel[Any]) -> SearchStrategy[Any]:
    """Any message of any type the channel carries."""
    return st.one_of(*(values_of(cls) for cls in channel.types))


@st.composite
def mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` with one to three edits: a bit flipped, a byte replaced, cut short, a slice cut out,
    bytes inserted (a length or a count that no longer matches what follows)."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "replace", "truncate", "cut", "insert"] if out else ["insert"]))
        if op == "insert":
            at = draw(st.integers(0, len(out)))
            out[at:at] = draw(st.binary(min_size=1, max_size=4))
            continue
        at = draw(st.integers(0, len(out) - 1))
        if op == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "replace":
            out[at] = draw(st.integers(0, 255))
        elif op == "truncate":
            del out[at:]
        else:
            del out[at : at + draw(st.integers(1, 8))]
    return bytes(out)


def check_decode(channel: Channel[Any], data: bytes) -> object | None:
    """Decode `data`: the message, or None when the channel refused it with its documented error.

    Anything else escaping (`RecursionError`, `UnicodeDecodeError`, `ValueError`, ...) fails the
    test. A message that did decode must mean exactly one thing: encoded again, it decodes to the
    same bytes (compared as bytes: a decoded NaN is not equal to itself)."""
    try:
        msg = channel.decode(data)
    except MessageDecodeError as exc:
        assert str(exc).startswith(f"{channel.name} channel: "), exc
        return None
    assert isinstance(msg, channel.types), msg
    again = channel.encode(msg)
    assert channel.encode(channel.decode(again)) == again
    return msg
