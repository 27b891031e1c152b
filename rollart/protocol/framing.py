"""Length-prefixed framing over TCP, with a zero-copy path for bulk payloads.

Wire format, big-endian:
- a message frame is a 4-byte length `L` followed by `L` bytes (one msgpack message);
- `L == 0xFFFFFFFF` marks a bulk frame: an 8-byte length `N` follows, then `N` raw bytes.

A header announcing more than the configured maximum is refused as soon as its 4 (or 12) bytes
arrive: the body is never read or allocated. Reading uses `asyncio.BufferedProtocol`, so the
kernel writes a bulk payload straight into its final buffer (one copy, kernel to destination),
and message frames are parsed out of one reusable receive buffer. Writes of small frames made in
the same loop iteration are coalesced into one `write` call per 16 KiB.

`Connection` is the interface sessions use; `memory.py` implements it without sockets.

One piece: `TcpConnection`'s reading of frames and its writing, coalesced and zero-copy for bulk, share one
buffered protocol and one transport.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, cast

from rollart.protocol.errors import ConnectionClosed, FrameTooLarge, ProtocolError
from rollart.protocol.frames import Bulk as _Bulk
from rollart.protocol.frames import FrameReceiver
from rollart.protocol.tls import NodeTls, TlsPeer, TlsRefused, refusal

_LEN = struct.Struct(">I")
_BULK_LEN = struct.Struct(">Q")
BULK_MARK = 0xFFFFFFFF
_RECV_CHUNK = 256 * 1024
INITIAL_RECV_BUFFER = 4 * 1024
"""A connection starts with this much receive buffer and grows to `_RECV_CHUNK` the first time it
fills: a connection that never gets past the handshake (a stranger, a scanner, a thousand dropped
connects) costs 4 KiB, not 256."""
_BULK_CHUNK = 1024 * 1024
_TLS_RECORDS = (0x15, 0x16)
"""First bytes of a TLS alert and handshake record (their second is 3, the major version): what a TLS
peer's first bytes look like to a node without TLS, whose 4-byte length they would be."""
_MAX_QUEUED_FRAMES = 4096  # stop reading from the socket past this many undelivered frames
# Write coalesced frames at once past this many bytes: a sender that queues thousands of frames
# without yielding would otherwise leave the receiver idle until it yields (measured: session
# one-way events 210k -> 370k msg/s on loopback, benchmarks/protocol.py).
_FLUSH_BYTES = 16 * 1024


class Connection(Protocol):
    """A framed, ordered, reliable byte connection (TCP, or in-memory for tests)."""

    @property
    def peer(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    max_frame_bytes: int
    """Frames above this size are refused (received) or raise (sent)."""

    @property
    def tls(self) -> TlsPeer | None:
        """What TLS established about the peer; None on a connection without TLS."""

    def send(self, frame: bytes) -> None:
        """Queue one message frame; it is written without waiting."""

    async def drain(self) -> None:
        """Wait until the write buffer is below its high-water mark."""

    async def recv(self) -> bytes:
        """The next message frame; `ConnectionClosed` at the end, `ProtocolError` on bad framing."""

    async def send_bulk(self, payload: bytes | bytearray | memoryview) -> None:
        """Write one bulk frame, in chunks, waiting for the socket between them."""

    async def recv_batch(self) -> list[bytes]:
        """Every message frame that has arrived (at least one), in order: one wake-up for many."""

    async def recv_bulk(self) -> memoryview:
        """The next frame, which must be a bulk frame."""

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


class SoonOnce:
    """Calls `fn` at the end of this loop iteration, once however often `soon` asks in it; calling
    the `SoonOnce` itself runs `fn` at once and settles what was asked. How the frames sent in one
    iteration share one write here, and the messages handled in one share an `Ack` (`link.py`)."""

    __slots__ = ("_fn", "_loop", "_pending")

    def __init__(self, fn: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        self._fn = fn
        self._loop = loop
        self._pending = False

    def __call__(self) -> None:
        self._pending = False
        self._fn()

    def soon(self) -> None:
        if not self._pending:
            self._pending = True
            self._loop.call_soon(self)


BulkSink = Callable[[int], memoryview]
"""Gives the buffer a bulk frame of N bytes is written into (default: a new bytearray)."""


class TcpConnection(FrameReceiver, asyncio.BufferedProtocol):
    """`Connection` over an asyncio transport (works with uvloop and the default loop)."""

    def __init__(
        self,
        max_frame_bytes: int,
        max_bulk_bytes: int,
        bulk_sink: BulkSink | None = None,
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_bulk_bytes = max_bulk_bytes
        self.bulk_sink = bulk_sink
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._peer = "?"
        self._buf = bytearray(INITIAL_RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte
        self._end = 0  # end of received bytes
        self._bulk: memoryview | None = None
        self._bulk_pos = 0
        self._frames: collections.deque[bytes | _Bulk] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._reading_paused = False
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush = SoonOnce(self._write_out, self._loop)
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._closed = self._loop.create_future()
        self._tls: TlsPeer | None = None
        self._frames_seen = False
        self._discarding = False  # closing after a refusal: what the peer still sends is dropped
        self.on_made: Callable[[TcpConnection], None] | None = None

    # -- asyncio protocol callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        self._peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        self._transport.set_write_buffer_limits(high=4 * _BULK_CHUNK)
        if self.on_made is not None:
            self.on_made(self)

    @property
    def transport(self) -> asyncio.Transport:
        """The transport under this connection."""
        if self._transport is None:
            raise ConnectionClosed(f"connection to {self._peer} is not connected")
        return self._transport

    def secured(self, peer: TlsPeer) -> None:
        """Record what the TLS under this connection established (`NodeTls` calls it)."""
        self._tls = peer

    @property
    def tls(self) -> TlsPeer | None:
        return self._tls

    def connection_lost(self, exc: Exception | None) -> None:
        if self._error is None:
            refused = refusal(exc) if exc is not None else None
            self._error = refused or ConnectionClosed(
                f"connection to {self._peer} closed" + (f": {exc}" if exc else "")
            )
        self._wake()
        self._can_write.set()
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._bulk is not None:
            return self._bulk[self._bulk_pos :]
        if self._end == len(self._buf):
            self._make_room(1)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._discarding:
            self._bulk, self._start, self._end = None, 0, 0
            return
        if self._bulk is not None:
            self._bulk_pos += nbytes
            if self._bulk_pos == len(self._bulk):
                self._deliver(_Bulk(self._bulk))
                self._bulk = None
            return
        self._end += nbytes
        if self._end == len(self._buf) and len(self._buf) < _RECV_CHUNK:
            self._make_room(_RECV_CHUNK)  # the peer filled the initial buffer: a busy connection
        if self._error is not None:
            return
        try:
            self._parse()
        except ProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False

    # -- parsing --

    def _make_room(self, need: int) -> None:
        """Move unparsed bytes to the front, growing the buffer when a frame needs more space."""
        pending = self._end - self._start
        if pending + need > len(self._buf):
            new = bytearray(pending + need)
            new[:pending] = self._view[self._start : self._end]
            self._buf, self._view = new, memoryview(new)
        elif self._start:
            self._view[:pending] = self._view[self._start : self._end]  # overlapping copy is safe
        self._start, self._end = 0, pending

    def _parse(self) -> None:
        view = self._view
        while True:
            avail = self._end - self._start
            if avail < 4:
                break
            (length,) = _LEN.unpack_from(view, self._start)
            if length == BULK_MARK:
                if avail < 12:
                    break
                (nbytes,) = _BULK_LEN.unpack_from(view, self._start + 4)
                if nbytes > self.max_bulk_bytes:
                    raise FrameTooLarge(f"bulk frame of {nbytes} bytes exceeds the limit of {self.max_bulk_bytes}")
                self._start += 12
                self._begin_bulk(nbytes)
                if self._bulk is not None:
                    return  # the rest of this bulk frame is written straight into its buffer
                continue
            if not self._frames_seen and view[self._start] in _TLS_RECORDS and view[self._start + 1] == 3:
                # A first frame is a handshake frame, far shorter than the 350 MB these bytes would announce.
                raise TlsRefused(f"{self._peer} speaks TLS and this node does not: set run.tls in its topology too")
            if length > self.max_frame_bytes:
                raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}")
            if avail < 4 + length:
                if self._start + 4 + length > len(self._buf):
                    self._make_room(4 + length - avail)
                break
            start = self._start + 4
            self._start = start + length
            self._frames_seen = True
            self._deliver(bytes(view[start : self._start]))
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > 4 * _RECV_CHUNK:  # give back the room a large frame needed
                self._buf = bytearray(_RECV_CHUNK)
                self._view = memoryview(self._buf)

    def _begin_bulk(self, nbytes: int) -> None:
        dest = self.bulk_sink(nbytes) if self.bulk_sink else memoryview(bytearray(nbytes))
        if len(dest) != nbytes:
            raise ProtocolError(f"bulk sink gave {len(dest)} bytes for a {nbytes}-byte frame")
        have = min(nbytes, self._end - self._start)
        dest[:have] = self._view[self._start : self._start + have]
        self._start += have
        if have == nbytes:
            self._deliver(_Bulk(dest))
        else:
            self._bulk, self._bulk_pos = dest, have
            self._start = self._end = 0

    def _deliver(self, item: bytes | _Bulk) -> None:
        self._frames.append(item)
        if len(self._frames) > _MAX_QUEUED_FRAMES and not self._reading_paused and self._transport:
            self._transport.pause_reading()
            self._reading_paused = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        # Stop reading but keep the socket: the owner may still send a refusal, then closes it.
        self._error = exc
        self._frames.clear()
        self._wake()
        if self._transport is not None and not self._reading_paused:
            self._transport.pause_reading()
            self._reading_paused = True

    # -- Connection interface --

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def closed(self) -> bool:
        return self._closed.done() or self._error is not None

    async def _arrived(self) -> None:
        """Wait until at least one frame is queued; raise the connection's error at its end."""
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _popped(self) -> None:
        if self._reading_paused and len(self._frames) < _MAX_QUEUED_FRAMES // 2 and self._transport:
            self._transport.resume_reading()
            self._reading_paused = False

    async def _next(self) -> bytes | _Bulk:
        await self._arrived()
        item = self._frames.popleft()
        self._popped()
        return item

    async def recv_batch(self) -> list[bytes]:
        await self._arrived()
        frames = self._frames
        batch: list[bytes] = []
        while frames and not isinstance(frames[0], _Bulk):
            batch.append(frames.popleft())  # type: ignore[arg-type]  # checked just above
        if not batch:
            raise ProtocolError("expected a message frame; got a bulk frame")
        self._popped()
        return batch

    def send(self, frame: bytes) -> None:
        if self._closed.done() or self._transport is None or self._transport.is_closing():
            raise ConnectionClosed(f"connection to {self._peer} closed")
        if len(frame) > self.max_frame_bytes:
            raise FrameTooLarge(f"refusing to send a {len(frame)}-byte frame (limit {self.max_frame_bytes})")
        self._out.append(_LEN.pack(len(frame)))
        self._out.append(frame)
        self._out_bytes += 4 + len(frame)
        if self._out_bytes >= _FLUSH_BYTES:
            self._flush()
        else:
            self._flush.soon()

    def _write_out(self) -> None:
        if self._out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
        self._out.clear()
        self._out_bytes = 0

    async def drain(self) -> None:
        self._flush()
        if not self._can_write.is_set():
            await self._can_write.wait()
        if self.closed:
            raise self._error or ConnectionClosed(f"connection to {self._peer} closed")

    async def send_bulk(self, payload: bytes | bytearray | memoryview) -> None:
        await self.send_bulk_parts([memoryview(payload).cast("B")])

    async def send_bulk_parts(self, parts: Sequence[memoryview]) -> None:
        """Write one bulk frame whose payload is `parts` back to back, from their own memory (no copy)."""
        if self.closed or self._transport is None:
            raise self._error or ConnectionClosed(f"connection to {self._peer} closed")
        nbytes = sum(len(part) for part in parts)
        if nbytes > self.max_bulk_bytes:
            raise FrameTooLarge(f"refusing to send a {nbytes}-byte bulk frame (limit {self.max_bulk_bytes})")
        self._flush()  # frames queued before this one go first
        self._transport.write(_LEN.pack(BULK_MARK) + _BULK_LEN.pack(nbytes))
        for part in parts:
            for offset in range(0, len(part), _BULK_CHUNK):
                self._transport.write(part[offset : offset + _BULK_CHUNK])
                if not self._can_write.is_set():
                    await self.drain()
        await self.drain()

    def close(self) -> None:
        self._flush()
        if self._transport is not None:
            self._transport.close()

    async def close_refused(self, linger_s: float) -> None:
        """Close so that the peer reads the refusal just sent. Closing a socket that holds bytes the
        peer sent and this side never read sends a reset, and a reset can discard the refusal before
        the peer reads it (seen: a client that sent a request right after its proof got ECONNRESET,
        not the refusal). So: send what is queued, end this direction, drop whatever the peer still
        sends, and close when it hangs up or after `linger_s` (a lingering close, as HTTP servers do)."""
        self._flush()
        transport = self._transport
        if transport is None or transport.is_closing() or not transport.can_write_eof():  # TLS cannot half-close
            self.close()
            return
        self._discarding = True  # `buffer_updated` drops what comes from here on
        self._frames.clear()
        transport.write_eof()
        if self._reading_paused:
            transport.resume_reading()
            self._reading_paused = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(linger_s):
                await asyncio.shield(self._closed)
        self.close()

    def abort(self) -> None:
        """Drop the connection at once, without flushing (tests use it to simulate a crash)."""
        if self._transport is not None:
            self._transport.abort()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)


async def open_tcp(
    host: str, port: int, *, max_frame_bytes: int, max_bulk_bytes: int, timeout: float, tls: NodeTls | None = None
) -> TcpConnection:
    """Connect to `host:port`, over TLS when `tls` is given; raises `OSError` or `TimeoutError` when it
    cannot, `TlsRefused` when TLS cannot be set up."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(timeout):
        if tls is not None:
            return await tls.connect(
                lambda: TcpConnection(max_frame_bytes, max_bulk_bytes), host, port, timeout=timeout
            )
        _, conn = await loop.create_connection(lambda: TcpConnection(max_frame_bytes, max_bulk_bytes), host, port)
    return conn


async def serve_tcp(
    host: str,
    port: int,
    on_connection: Callable[[TcpConnection], Awaitable[None] | None],
    *,
    max_frame_bytes: int,
    max_bulk_bytes: int,
) -> asyncio.Server:
    """Listen on `host:port` and call `on_connection(conn)` for every accepted connection (for TLS:
    `NodeTls.serve`)."""
    loop = asyncio.get_running_loop()

    def factory() -> TcpConnection:
        conn = TcpConnection(max_frame_bytes, max_bulk_bytes)
        conn.on_made = on_connection  # type: ignore[assignment]
        return conn

    return await loop.create_server(factory, host, port, reuse_address=True)
