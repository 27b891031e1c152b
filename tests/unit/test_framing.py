"""Tests of the TCP framing: `TcpConnection` fed bytes the way the event loop feeds a
`BufferedProtocol`, with a hand-written fake transport, including any bytes at all (fuzzed against
a reference parser); then one real loopback connection."""

from __future__ import annotations

import asyncio
import random
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rollart.protocol.errors import ConnectionClosed, FrameTooLarge, ProtocolError
from rollart.protocol.framing import BULK_MARK, TcpConnection, _Bulk, open_tcp, serve_tcp
from rollart.workers.framing import frame
from tests.strategies import FUZZ_EXAMPLES

RECV_BUFFER = 256 * 1024  # TcpConnection's receive buffer once a peer has filled the initial one
INITIAL_RECV_BUFFER = 4 * 1024


class FakeTransport:
    """The part of `asyncio.Transport` that `TcpConnection` uses, recording what it is asked to do."""

    def __init__(self, protocol: TcpConnection) -> None:
        self.protocol = protocol
        self.written = bytearray()
        self.writes = 0
        self.paused = False
        self.pauses = 0
        self.closing = False
        self.eof = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("203.0.113.7", 4242) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "write after close"
        assert not self.eof, "write after write_eof"
        self.written += data
        self.writes += 1

    def pause_reading(self) -> None:
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()


def connected(
    max_frame_bytes: int = 16 * 1024 * 1024, max_bulk_bytes: int = 1 << 30, **kwargs: Any
) -> tuple[TcpConnection, FakeTransport]:
    conn = TcpConnection(max_frame_bytes, max_bulk_bytes, **kwargs)
    transport = FakeTransport(conn)
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def feed(conn: TcpConnection, data: bytes | bytearray, chunks: list[int] | None = None) -> None:
    """Deliver `data` as the event loop would: ask for a buffer, fill up to `chunk` bytes of it."""
    view = memoryview(data)
    sizes = chunks or [len(data) or 1]
    pos = i = 0
    while pos < len(view):
        buf = conn.get_buffer(-1)
        assert len(buf) > 0, "get_buffer gave an empty buffer"
        n = min(len(buf), sizes[i % len(sizes)], len(view) - pos)
        buf[:n] = view[pos : pos + n]
        conn.buffer_updated(n)
        pos += n
        i += 1


def bulk_frame(payload: bytes) -> bytes:
    return struct.pack(">IQ", BULK_MARK, len(payload)) + payload


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


# A frame: ("msg" or "bulk", size, seed); the bytes are derived from the seed so large frames are cheap.
small_frames = st.tuples(st.just("msg"), st.integers(0, 4096), st.integers(0, 2**16))
large_frames = st.tuples(st.just("msg"), st.integers(RECV_BUFFER - 8, 3 * RECV_BUFFER), st.integers(0, 2**16))
bulk_frames = st.tuples(st.just("bulk"), st.integers(0, 2 * RECV_BUFFER), st.integers(0, 2**16))
frame_lists = st.lists(
    st.one_of(small_frames, small_frames, small_frames, large_frames, bulk_frames), min_size=1, max_size=40
).filter(lambda frames: sum(size for _, size, _ in frames) <= 4 * 1024 * 1024)
chunk_sizes = st.lists(
    st.one_of(st.integers(1, 16), st.integers(1, 8192), st.integers(8192, 2 * RECV_BUFFER)), min_size=1, max_size=12
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=frame_lists, chunks=chunk_sizes)
async def test_any_frames_in_any_chunks_arrive_intact_and_in_order(
    frames: list[tuple[str, int, int]], chunks: list[int]
) -> None:
    # Tiny chunks over megabytes would make the example slow without testing anything new.
    if min(chunks) < 64 and sum(size for _, size, _ in frames) > 256 * 1024:
        chunks = [max(64, c) for c in chunks]
    event(f"frame larger than the receive buffer: {any(size > RECV_BUFFER for _, size, _ in frames)}")
    event(f"bulk frame: {any(kind == 'bulk' for kind, _, _ in frames)}")
    conn, _ = connected()
    wire = bytearray()
    expected: list[tuple[str, bytes]] = []
    for kind, size, seed in frames:
        data = payload(size, seed)
        wire += frame(data) if kind == "msg" else bulk_frame(data)
        expected.append((kind, data))
    feed(conn, wire, chunks)
    for kind, data in expected:
        if kind == "msg":
            got = await conn.recv()
            assert isinstance(got, bytes)
        else:
            got = bytes(await conn.recv_bulk())
        assert len(got) == len(data)
        assert got == data
    conn.connection_lost(None)
    with pytest.raises(ConnectionClosed):
        await conn.recv()  # nothing more than what was sent


async def test_receive_buffer_shrinks_after_a_very_large_frame() -> None:
    conn, _ = connected()
    big = payload(5 * RECV_BUFFER, 1)
    feed(conn, frame(big) + frame(b"after"), [100_000])
    assert await conn.recv() == big
    assert await conn.recv() == b"after"
    assert len(conn._buf) == RECV_BUFFER


async def test_bulk_payload_lands_in_the_sink_buffer() -> None:
    dest = bytearray(300_000)
    sizes: list[int] = []

    def sink(nbytes: int) -> memoryview:
        sizes.append(nbytes)
        return memoryview(dest)[:nbytes]

    conn, _ = connected(bulk_sink=sink)
    data = payload(300_000, 2)
    feed(conn, frame(b"header") + bulk_frame(data) + frame(b"trailer"), [4096])
    assert await conn.recv() == b"header"
    view = await conn.recv_bulk()
    assert view.obj is dest  # written in place, not copied into a new buffer
    assert bytes(view) == data
    assert await conn.recv() == b"trailer"
    assert sizes == [300_000]


async def test_message_frame_where_a_bulk_frame_is_expected_is_a_protocol_error() -> None:
    conn, _ = connected()
    feed(conn, frame(b"x") + bulk_frame(b"y"))
    with pytest.raises(ProtocolError, match="expected a bulk frame"):
        await conn.recv_bulk()
    with pytest.raises(ProtocolError, match="expected a message frame"):
        await conn.recv()


# -- any bytes at all ----------------------------------------------------------------------------


def reference_frames(wire: bytes, max_frame: int, max_bulk: int) -> tuple[list[tuple[str, bytes]], type | None]:
    """What the module docstring's wire format says `wire` holds: the complete frames in order, and
    the error a header breaks it with (None: the bytes end, maybe inside a frame)."""
    frames: list[tuple[str, bytes]] = []
    pos = 0
    while len(wire) - pos >= 4:
        (length,) = struct.unpack_from(">I", wire, pos)
        if length == BULK_MARK:
            if len(wire) - pos < 12:
                break
            (length,) = struct.unpack_from(">Q", wire, pos + 4)
            kind, start, limit = "bulk", pos + 12, max_bulk
        else:
            kind, start, limit = "msg", pos + 4, max_frame
        if length > limit:
            return frames, FrameTooLarge
        if len(wire) - start < length:
            break
        frames.append((kind, wire[start : start + length]))
        pos = start + length
    return frames, None


# Valid frames, headers of any size (most of them over the limits), and noise, run together.
wire_parts = st.one_of(
    st.binary(max_size=48).map(frame),
    st.binary(max_size=48).map(bulk_frame),
    st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    st.integers(0, 2**64 - 1).map(lambda n: struct.pack(">IQ", BULK_MARK, n)),
    st.integers(0, 96).map(lambda n: struct.pack(">I", n)),
    st.binary(min_size=1, max_size=12),
)


@settings(max_examples=3 * FUZZ_EXAMPLES, deadline=None)
@given(
    wire=st.lists(wire_parts, max_size=10).map(b"".join),
    chunks=st.lists(st.integers(1, 64), min_size=1, max_size=6),
    max_frame=st.integers(0, 80),
    max_bulk=st.integers(0, 80),
)
async def test_fuzz_any_bytes_give_the_frames_they_hold_or_a_framing_error(
    wire: bytes, chunks: list[int], max_frame: int, max_bulk: int
) -> None:
    conn, transport = connected(max_frame_bytes=max_frame, max_bulk_bytes=max_bulk)
    feed(conn, wire, chunks)  # the protocol callbacks never raise: errors wait for the reader
    conn.connection_lost(None)
    expected, error = reference_frames(wire, max_frame, max_bulk)
    event(f"refused: {error is not None}")
    if error is not None:
        assert transport.paused  # it stopped reading at the bad header
        with pytest.raises(error):  # and what came before it is dropped with the connection
            await conn._next()
        return
    for kind, data in expected:
        got = await conn._next()
        assert (kind, bytes(got.view) if isinstance(got, _Bulk) else got) == (kind, data)
    with pytest.raises(ConnectionClosed):
        await conn._next()


# -- limits ------------------------------------------------------------------------------------


async def test_oversized_header_is_refused_when_its_four_bytes_arrive() -> None:
    limit = 1024 * 1024  # larger than the receive buffer: accepting the header would grow it
    conn, transport = connected(max_frame_bytes=limit)
    feed(conn, frame(b"fine"))
    assert await conn.recv() == b"fine"
    header = struct.pack(">I", limit + 1)
    feed(conn, header[:3])
    assert not conn.closed
    feed(conn, header[3:])
    assert conn.closed
    assert transport.paused  # stops reading the body
    with pytest.raises(FrameTooLarge, match=f"frame of {limit + 1} bytes exceeds the limit of {limit}"):
        await conn.recv()
    assert len(conn._buf) == INITIAL_RECV_BUFFER  # the body was never allocated


async def test_a_connection_starts_small_and_grows_once_a_peer_fills_it() -> None:
    conn, _ = connected()
    assert len(conn._buf) == INITIAL_RECV_BUFFER  # a connection that never gets going costs 4 KiB
    frames = [payload(1000, i) for i in range(20)]  # 20 KiB of small frames, more than fits
    feed(conn, b"".join(frame(f) for f in frames))
    assert [await conn.recv() for _ in frames] == frames
    assert len(conn._buf) >= RECV_BUFFER  # filled once: the usual receive buffer from then on


async def test_header_at_the_limit_is_accepted() -> None:
    limit = RECV_BUFFER + 10
    conn, _ = connected(max_frame_bytes=limit)
    data = payload(limit, 3)
    feed(conn, frame(data), [65536])
    assert await conn.recv() == data


async def test_oversized_bulk_header_is_refused_before_the_sink_is_asked() -> None:
    asked: list[int] = []

    def sink(nbytes: int) -> memoryview:
        asked.append(nbytes)
        return memoryview(bytearray(nbytes))

    conn, transport = connected(max_bulk_bytes=1 << 20, bulk_sink=sink)
    header = struct.pack(">IQ", BULK_MARK, 2 << 30)
    feed(conn, header[:11])
    assert not conn.closed
    feed(conn, header[11:])
    assert conn.closed and transport.paused
    with pytest.raises(FrameTooLarge, match="bulk frame of 2147483648 bytes exceeds the limit of 1048576"):
        await conn.recv_bulk()
    assert asked == []
    assert len(conn._buf) == INITIAL_RECV_BUFFER


async def test_frames_queued_past_the_limit_pause_reading_until_consumed() -> None:
    conn, transport = connected()
    feed(conn, b"".join(frame(i.to_bytes(2, "big")) for i in range(5000)))
    assert transport.paused
    for i in range(5000):
        assert await conn.recv() == i.to_bytes(2, "big")
    assert not transport.paused


# -- sending -----------------------------------------------------------------------------------


async def test_frames_sent_in_one_iteration_are_coalesced_into_one_write() -> None:
    conn, transport = connected()
    conn.send(b"one")
    conn.send(b"")
    conn.send(b"three")
    await conn.drain()
    assert transport.writes == 1
    assert bytes(transport.written) == frame(b"one") + frame(b"") + frame(b"three")


async def test_send_bulk_writes_queued_frames_first_then_the_bulk_frame() -> None:
    conn, transport = connected()
    data = payload(3 * 1024 * 1024 + 5, 4)
    conn.send(b"before")
    await conn.send_bulk(data)
    assert bytes(transport.written) == frame(b"before") + bulk_frame(data)


async def test_send_above_the_limit_raises_locally_and_sends_nothing() -> None:
    conn, transport = connected(max_frame_bytes=1000)
    with pytest.raises(FrameTooLarge, match="1001-byte frame"):
        conn.send(b"x" * 1001)
    conn.send(b"x" * 1000)
    await conn.drain()
    assert bytes(transport.written) == frame(b"x" * 1000)


async def test_bulk_send_above_the_limit_raises_locally_and_sends_nothing() -> None:
    conn, transport = connected(max_bulk_bytes=1000)
    with pytest.raises(FrameTooLarge, match="1001-byte bulk frame"):
        await conn.send_bulk(b"x" * 1001)
    assert bytes(transport.written) == b""


async def test_send_after_close_raises_connection_closed() -> None:
    conn, _ = connected()
    conn.close()
    await conn.wait_closed()
    with pytest.raises(ConnectionClosed):
        conn.send(b"late")
    with pytest.raises(ConnectionClosed):
        await conn.recv()


async def test_close_refused_sends_the_refusal_ends_its_side_and_drops_what_the_peer_still_sends() -> None:
    conn, transport = connected(max_frame_bytes=1024)
    feed(conn, struct.pack(">I", 4096))  # an oversized header: reading stops, the owner refuses
    assert transport.paused
    conn.send(b"refused")
    closing = asyncio.create_task(conn.close_refused(linger_s=5.0))
    await asyncio.sleep(0)
    assert transport.written == frame(b"refused") and transport.eof  # sent, then this side ended
    assert not transport.paused and not transport.closing  # reads on, so the peer gets no reset
    feed(conn, b"\x00" * 10_000)  # the peer goes on sending: dropped, not buffered
    assert conn._end == 0 and len(conn._buf) == INITIAL_RECV_BUFFER
    transport.close()  # the peer hung up (the transport closes on its end of stream)
    async with asyncio.timeout(1):
        await closing


async def test_close_refused_closes_after_the_linger_when_the_peer_stays() -> None:
    conn, transport = connected()
    async with asyncio.timeout(1):
        await conn.close_refused(linger_s=0.05)
    assert transport.eof and transport.closing


# -- real loopback TCP -------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_loopback_tcp_delivers_frames_and_a_bulk_payload_in_order() -> None:
    limit = 1024 * 1024
    accepted: asyncio.Future[TcpConnection] = asyncio.get_running_loop().create_future()
    server = await serve_tcp(
        "127.0.0.1", 0, accepted.set_result, max_frame_bytes=limit, max_bulk_bytes=64 * 1024 * 1024
    )
    port = server.sockets[0].getsockname()[1]
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 100, 1000, 5000, 70_000]) for _ in range(1000)]
    sizes[100::100] = [400_000, limit] * 4 + [limit]  # a few larger than the receive buffer
    frames = [rng.randbytes(size) for size in sizes]
    bulk = payload(5 * 1024 * 1024, 6)
    try:
        client = await open_tcp("127.0.0.1", port, max_frame_bytes=limit, max_bulk_bytes=64 * 1024 * 1024, timeout=5)
        async with asyncio.timeout(10):
            peer = await accepted
        with pytest.raises(FrameTooLarge):
            client.send(b"x" * (limit + 1))

        async def sender() -> None:
            for i, data in enumerate(frames):
                client.send(data)
                if i % 50 == 0:
                    await client.drain()
            await client.send_bulk(bulk)

        async def receiver() -> None:
            for i, data in enumerate(frames):
                got = await peer.recv()
                assert got == data, f"frame {i} differs"
            assert bytes(await peer.recv_bulk()) == bulk

        async with asyncio.timeout(20), asyncio.TaskGroup() as tg:
            tg.create_task(sender())
            tg.create_task(receiver())
        client.close()
        with pytest.raises(ConnectionClosed):
            await peer.recv()  # the oversized frame was never sent
    finally:
        server.close()
        await server.wait_closed()
