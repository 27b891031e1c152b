"""Tests of the message channels: every message round-trips, and every kind of bad input fails with
a `MessageDecodeError` that names the channel and what was wrong."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollart.protocol.errors import MessageDecodeError
from rollart.protocol.messages import (
    BLOB,
    CONTROL,
    HANDSHAKE,
    SESSION,
    Ack,
    BlobHeader,
    Bye,
    Echo,
    Kind,
    Msg,
    NodeStatus,
    Notice,
    StatusRequest,
)

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


@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_message_decode_error(data: bytes) -> None:
    for channel, name in [(CONTROL, "control"), (SESSION, "session"), (HANDSHAKE, "handshake")]:
        try:
            msg = channel.decode(data)
        except MessageDecodeError as exc:
            assert str(exc).startswith(f"{name} channel: ")
        else:
            # Random bytes that happen to be a valid message must mean exactly that message
            # (compared as bytes: a decoded NaN is not equal to itself).
            assert isinstance(msg, channel.types)
            again = channel.encode(msg)
            assert channel.encode(channel.decode(again)) == again
