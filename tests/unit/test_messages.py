"""Tests of the message channels: every message round-trips, and every kind of bad input fails with
a `MessageDecodeError` that names the channel and what was wrong; then every channel fuzzed (any
message, mutated encodings, msgpack of any shape, random bytes) with nothing else escaping."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart.protocol import messages
from rollart.protocol.errors import MessageDecodeError
from rollart.protocol.messages import (
    APP,
    BLOB,
    CONTROL,
    DECODE_ERRORS,
    HANDSHAKE,
    REMOTE_FAILURE,
    SESSION,
    Ack,
    BlobHeader,
    Bye,
    Channel,
    Echo,
    Kind,
    Msg,
    NodeStatus,
    Notice,
    Proof,
    RemoteFailure,
    Scored,
    StatusRequest,
)
from tests.strategies import FUZZ_EXAMPLES, check_decode, messages_of, msgpack_trees, mutations, tagged_trees

# msgpack integers are 64-bit; the wire fields that carry counters are unsigned in practice.
u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
finite = st.floats(allow_nan=False)

control_messages = st.one_of(
    st.builds(StatusRequest),
    st.builds(
        NodeStatus, node=st.text(), role=st.text(), uptime_s=finite, paused=st.booleans(), draining=st.booleans()
    ),
    st.builds(Echo, n=i64, data=st.binary(max_size=512)),
    st.builds(Echo, n=i64),  # the default `data` is omitted on the wire
    st.builds(Notice, text=st.text()),
)


def test_control_channel_knows_every_message_type() -> None:
    assert set(CONTROL.types) == {StatusRequest, NodeStatus, Echo, Notice}
    assert CONTROL.tags == ["status?", "status", "echo", "notice"]


@given(control_messages)
def test_control_messages_round_trip(msg: object) -> None:
    decoded = CONTROL.decode(CONTROL.encode(msg))
    assert decoded == msg
    assert type(decoded) is type(msg)


@given(fields=st.tuples(u64, u64, st.sampled_from(Kind), u64, u64), body=control_messages)
def test_session_msg_frames_round_trip_with_any_body(fields: tuple[int, int, Kind, int, int], body: object) -> None:
    encoded_body = CONTROL.encode(body)
    frame = Msg(*fields, body=msgspec.Raw(encoded_body))
    decoded = SESSION.decode(SESSION.encode(frame))
    assert isinstance(decoded, Msg)
    assert (decoded.seq, decoded.ack, decoded.kind, decoded.corr, decoded.timeout_ms) == fields
    assert bytes(decoded.body) == encoded_body
    assert CONTROL.decode(decoded.body) == body


@given(st.one_of(st.builds(Ack, ack=u64), st.builds(Bye, reason=st.text())))
def test_other_session_frames_round_trip(frame: object) -> None:
    assert SESSION.decode(SESSION.encode(frame)) == frame


def test_blob_header_round_trips_with_meta() -> None:
    header = BlobHeader("weights-v3", 1 << 33, {"version": 3, "dtype": "bf16"})
    assert BLOB.decode(BLOB.encode(header)) == header


# -- bad input ---------------------------------------------------------------------------------


def _decode_error(channel: object, data: bytes) -> str:
    with pytest.raises(MessageDecodeError) as info:
        channel.decode(data)  # type: ignore[attr-defined]
    return str(info.value)


def test_unknown_tag_names_the_tag_and_the_known_ones() -> None:
    text = _decode_error(CONTROL, msgspec.msgpack.encode(["zz", 1]))
    assert text.startswith("control channel:")
    assert "unknown message tag 'zz'" in text
    assert "'echo'" in text  # the known tags are listed


def test_a_session_frame_is_not_a_control_message() -> None:
    text = _decode_error(CONTROL, SESSION.encode(Ack(3)))
    assert "control channel" in text
    assert "unknown message tag 'a'" in text


def test_wrong_field_type_names_the_expected_type() -> None:
    text = _decode_error(CONTROL, msgspec.msgpack.encode(["echo", "not a number"]))
    assert text.startswith("control channel:")
    assert "Expected `int`" in text


def test_wrong_enum_value_in_a_session_frame() -> None:
    text = _decode_error(SESSION, msgspec.msgpack.encode(["m", 1, 0, 9]))
    assert text.startswith("session channel:")
    assert "enum" in text


def test_trailing_garbage_is_refused() -> None:
    text = _decode_error(CONTROL, CONTROL.encode(Echo(1)) + b"\x00")
    assert text.startswith("control channel:")
    assert "trailing characters" in text


@pytest.mark.parametrize("cut", [1, 2, 5])
def test_truncated_input_is_refused(cut: int) -> None:
    data = CONTROL.encode(Echo(7, b"payload"))
    text = _decode_error(CONTROL, data[:-cut])
    assert text.startswith("control channel:")
    assert "truncated" in text


def test_empty_input_is_refused() -> None:
    assert "truncated" in _decode_error(HANDSHAKE, b"")


# -- fuzzing: nothing but a MessageDecodeError escapes a channel --------------------------------

CHANNELS: list[Channel[Any]] = [value for value in vars(messages).values() if isinstance(value, Channel)]
"""Every channel of the protocol, found in the module so a new one is fuzzed too (the weights
channel is fuzzed in test_weights.py)."""
by_name = pytest.mark.parametrize("channel", CHANNELS, ids=[channel.name for channel in CHANNELS])


def test_every_protocol_channel_is_fuzzed() -> None:
    assert {channel.name for channel in CHANNELS} >= {"handshake", "session", "control", "app", "blob"}


@by_name
@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_fuzz_any_message_round_trips_and_its_mutations_decode_or_are_refused(
    channel: Channel[Any], data: st.DataObject
) -> None:
    encoded = channel.encode(data.draw(messages_of(channel), label="message"))
    assert check_decode(channel, encoded) is not None
    check_decode(channel, data.draw(mutations(encoded), label="mutated"))


@by_name
@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_fuzz_msgpack_of_any_shape_decodes_or_is_refused(channel: Channel[Any], data: st.DataObject) -> None:
    value = data.draw(st.one_of(msgpack_trees, tagged_trees(channel)), label="value")
    check_decode(channel, msgspec.msgpack.encode(value))


@settings(max_examples=3 * FUZZ_EXAMPLES, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_message_decode_error(data: bytes) -> None:
    for channel in CHANNELS:
        check_decode(channel, data)


DEEP = b"\x91" * 5000 + b"\xc0"
"""msgpack nested 5,000 deep (2 KiB): deeper than msgspec can follow within Python's recursion limit."""


def with_trailing(encoded: bytes, extra: bytes) -> bytes:
    """An array-like message with one more element than its struct has (ignored, but still parsed)."""
    if 0x90 <= encoded[0] < 0x9F:
        return bytes([encoded[0] + 1]) + encoded[1:] + extra
    assert encoded[0] == 0xDC  # array 16
    return b"\xdc" + (int.from_bytes(encoded[1:3], "big") + 1).to_bytes(2, "big") + encoded[3:] + extra


@pytest.mark.parametrize(
    ("channel", "data"),
    [
        (HANDSHAKE, with_trailing(HANDSHAKE.encode(Proof(b"mac")), DEEP)),  # what a stranger can send first
        (SESSION, with_trailing(SESSION.encode(Ack(1)), DEEP)),
        (SESSION, SESSION.encode(Msg(1, 0, Kind.EVENT, body=msgspec.Raw(DEEP)))),  # skipped as a raw body
        (CONTROL, with_trailing(CONTROL.encode(Echo(1)), DEEP)),
        (APP, with_trailing(APP.encode(Scored(1.0, {"k": 1})), DEEP)),
        (REMOTE_FAILURE, with_trailing(REMOTE_FAILURE.encode(RemoteFailure("code", "message")), DEEP)),
        (BLOB, with_trailing(BLOB.encode(BlobHeader("w", 1)), DEEP)),
    ],
    ids=["handshake", "session", "session-body", "control", "app", "remote-failure", "blob"],
)
def test_nesting_deeper_than_the_recursion_limit_is_a_decode_error(channel: Channel[Any], data: bytes) -> None:
    # Found by fuzzing: msgspec raises RecursionError, which escaped `decode` and every hot path
    # that catches decode errors; one such frame in a handshake stopped a node.
    with pytest.raises(MessageDecodeError, match=f"^{channel.name} channel: malformed msgpack: nested too deeply"):
        channel.decode(data)
    with pytest.raises(RecursionError) as info:  # the hot paths' native decode, then `explain`
        channel.decode_native(data)
    assert isinstance(info.value, DECODE_ERRORS)  # what they catch
    assert str(channel.explain(info.value)) == f"{channel.name} channel: malformed msgpack: nested too deeply"


def invalid_utf8(encoded: bytes, text: str) -> bytes:
    """`encoded` with the string `text` in it made invalid UTF-8 (its first byte a lone continuation byte)."""
    assert encoded.count(text.encode()) == 1
    return encoded.replace(text.encode(), b"\x80" + text.encode()[1:])


@pytest.mark.parametrize(
    ("channel", "data"),
    [
        (HANDSHAKE, invalid_utf8(HANDSHAKE.encode(Proof(b"mac")), "proof")),  # a tag
        (SESSION, invalid_utf8(SESSION.encode(Bye("why")), "why")),  # a field
        (APP, invalid_utf8(APP.encode(Scored(1.0, {"key": 1})), "key")),  # a dict key
        (REMOTE_FAILURE, invalid_utf8(REMOTE_FAILURE.encode(RemoteFailure("code", "message")), "message")),
        (BLOB, invalid_utf8(BLOB.encode(BlobHeader("w", 1, {"k": "value"})), "value")),  # a value of any type
    ],
    ids=["handshake-tag", "session-field", "app-dict-key", "remote-failure-field", "blob-any"],
)
def test_invalid_utf8_in_any_string_is_a_decode_error(channel: Channel[Any], data: bytes) -> None:
    # Found by fuzzing under msgspec 0.19, which raises UnicodeDecodeError (0.23: a DecodeError).
    expected = f"^{channel.name} channel: malformed msgpack: Invalid UTF-8"
    with pytest.raises(MessageDecodeError, match=expected):
        channel.decode(data)
    with pytest.raises(DECODE_ERRORS) as info:  # the hot paths' native decode, then `explain`
        channel.decode_native(data)
    assert re.match(expected, str(channel.explain(info.value)))
