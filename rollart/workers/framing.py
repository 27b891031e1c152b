"""Frames between a pool and its worker processes: a 4-byte big-endian length, then the payload.

The format of `rollart.protocol.framing`'s message frames (bulk frames are not used), written here
so that worker processes need nothing of the wire. The pool's side reads its non-blocking socket
with a `FrameReader`, which refuses a frame longer than its maximum: what a worker sends is not
trusted, and a longer frame is a broken or hostile worker. The worker's side blocks on its socket
(`recv_frame`, `send_frame`): it serves one parent and has nothing else to do.

Payloads are msgpack-encoded structs of a tagged union, decoded by a typed decoder that may raise
any of `DECODE_ERRORS`; nothing a worker sends is ever unpickled.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import BinaryIO, TypeVar

import msgspec

DECODE_ERRORS = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
"""What a msgspec decoder raises on bad bytes: its `DecodeError`; `RecursionError` for msgpack nested
past Python's limit (msgspec recurses once per level, into an `Any` field or to skip an element);
`UnicodeDecodeError` for invalid UTF-8 in msgspec before 0.23 (`rollart.protocol.messages.channel`)."""

T = TypeVar("T")

_LEN = struct.Struct(">I")
HEADER_BYTES = _LEN.size


def frame(payload: bytes) -> bytes:
    """One frame: the payload's length, then the payload."""
    return _LEN.pack(len(payload)) + payload


def frame_length(header: bytes | bytearray | memoryview, offset: int = 0) -> int:
    """The payload length a frame header at `offset` announces."""
    length: int = _LEN.unpack_from(header, offset)[0]
    return length


class FrameTooLong(ValueError):
    """A frame announced more bytes than its reader takes: the stream is broken."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a {size}-byte frame (at most {limit})")
        self.size = size
        self.limit = limit


class FrameReader:
    """The pool's side of one worker's stream: bytes in as they arrive, whole payloads out."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        """The longest payload taken; a longer one raises `FrameTooLong`."""
        self._buffer = bytearray()

    def frames(self, data: bytes) -> Iterator[bytes]:
        """Add `data` and yield every whole payload it completes, in order; `FrameTooLong` as soon as
        a header announces more than `max_bytes` (the stream cannot be read any further)."""
        buffer = self._buffer
        buffer += data
        while len(buffer) >= HEADER_BYTES:
            size = frame_length(buffer)
            if size > self.max_bytes:
                raise FrameTooLong(size, self.max_bytes)
            if len(buffer) < HEADER_BYTES + size:
                return
            payload = bytes(buffer[HEADER_BYTES : HEADER_BYTES + size])
            del buffer[: HEADER_BYTES + size]
            yield payload


def decode_stream(reader: FrameReader, data: bytes, decoder: msgspec.msgpack.Decoder[T]) -> tuple[list[T], str | None]:
    """The whole messages in what arrived so far (`data` added to `reader`), and what is wrong with
    the stream if something is (a frame over the reader's maximum, bytes that are not a message): a
    worker that sends that is broken, and nothing after it can be read."""
    messages: list[T] = []
    try:
        for payload in reader.frames(data):
            messages.append(decoder.decode(payload))
    except FrameTooLong as exc:
        return messages, f"it sent a {exc.size}-byte reply (at most {exc.limit})"
    except DECODE_ERRORS as exc:
        return messages, f"it sent a reply that is not valid: {exc}"
    return messages, None


def recv_frame(stream: BinaryIO) -> bytes | None:
    """The next payload from a blocking stream (`socket.makefile("rb")`); None at EOF (the parent is gone)."""
    header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return None
    size = frame_length(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Write one frame on a blocking socket (`OSError` once the parent is gone)."""
    sock.sendall(frame(payload))
