"""An in-memory `Connection` with the same behaviour as TCP, for unit tests and the simulator.

`MemoryNetwork` maps addresses to listeners; `connect` returns one end of a connected pair.
Frame limits are enforced as on TCP. `break_all()` drops every connection at once, the way a
network partition or a crashed peer would, so session resumption can be tested without sockets.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from rollart.protocol.errors import ConnectionClosed, FrameTooLarge
from rollart.protocol.frames import Bulk, FrameReceiver


class MemoryConnection(FrameReceiver):
    """One end of an in-memory connection."""

    def __init__(self, name: str, max_frame_bytes: int, max_bulk_bytes: int) -> None:
        self._name = name
        self.max_frame_bytes = max_frame_bytes
        self.max_bulk_bytes = max_bulk_bytes
        self._frames: collections.deque[bytes | Bulk] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        """The receiver waiting for a frame or the close, if one is."""
        self._closed = asyncio.Event()
        self._error: BaseException | None = None
        self.other: MemoryConnection | None = None
        self.silent = False
        """When set, frames sent from this end vanish (a hung peer that still holds its socket)."""

    @property
    def peer(self) -> str:
        return self.other._name if self.other else "?"

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def tls(self) -> None:
        """In memory there is no TLS (and no network to protect)."""
        return None

    def _check_open(self) -> MemoryConnection:
        if self._closed.is_set() or self.other is None:
            raise self._error or ConnectionClosed(f"connection to {self.peer} closed")
        return self.other

    def send(self, frame: bytes) -> None:
        other = self._check_open()
        if len(frame) > other.max_frame_bytes:
            raise FrameTooLarge(f"refusing to send a {len(frame)}-byte frame (limit {other.max_frame_bytes})")
        if not self.silent:
            other._frames.append(bytes(frame))
            other._wake()

    async def drain(self) -> None:
        self._check_open()
        await asyncio.sleep(0)

    async def send_bulk(self, payload: bytes | bytearray | memoryview) -> None:
        other = self._check_open()
        if len(payload) > other.max_bulk_bytes:
            raise FrameTooLarge(f"bulk frame of {len(payload)} bytes exceeds the limit of {other.max_bulk_bytes}")
        if not self.silent:
            other._frames.append(Bulk(memoryview(bytearray(payload))))
            other._wake()
        await asyncio.sleep(0)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _next(self) -> bytes | Bulk:
        # One future per wait, resolved by a frame or the close: the simulator's hot path (two
        # tasks and an asyncio.wait per frame cost more than the rest of receiving it).
        while not self._frames:  # frames sent before the peer closed are still delivered
            if self._closed.is_set():
                raise self._error or ConnectionClosed(f"connection to {self.peer} closed")
            if self._waiter is not None:  # as asyncio's StreamReader: one reader at a time
                raise RuntimeError("another coroutine is already waiting for a frame on this connection")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()

    async def recv_batch(self) -> list[bytes]:
        batch = [await self.recv()]
        while self._frames and not isinstance(self._frames[0], Bulk):
            batch.append(self._frames.popleft())  # type: ignore[arg-type]  # checked just above
        return batch

    def _shut(self, error: BaseException) -> None:
        if not self._closed.is_set():
            self._error = error
            self._closed.set()
            self._wake()

    def close(self) -> None:
        self._frames.clear()
        self._shut(ConnectionClosed(f"connection to {self.peer} closed"))
        if self.other is not None:
            self.other._shut(ConnectionClosed(f"connection to {self._name} closed by peer"))

    def abort(self) -> None:
        """Drop the connection in both directions, losing frames in flight (a crash or a partition)."""
        if self.other is not None:
            self.other._frames.clear()
        self.close()

    async def wait_closed(self) -> None:
        await self._closed.wait()


@dataclass
class MemoryNetwork:
    """Named listeners and every connection made through them."""

    max_frame_bytes: int = 16 * 1024 * 1024
    max_bulk_bytes: int = 1 << 34
    listeners: dict[str, Callable[[MemoryConnection], object]] = field(default_factory=dict)
    connections: list[MemoryConnection] = field(default_factory=list)

    def listen(self, address: str, on_connection: Callable[[MemoryConnection], object]) -> None:
        self.listeners[address] = on_connection

    def unlisten(self, address: str) -> None:
        self.listeners.pop(address, None)

    async def connect(self, address: str, client_name: str = "client") -> MemoryConnection:
        """Connect to a listener; raises `ConnectionRefusedError` when none listens there."""
        await asyncio.sleep(0)
        on_connection = self.listeners.get(address)
        if on_connection is None:
            raise ConnectionRefusedError(f"nothing listens on memory address {address!r}")
        client = MemoryConnection(client_name, self.max_frame_bytes, self.max_bulk_bytes)
        server = MemoryConnection(address, self.max_frame_bytes, self.max_bulk_bytes)
        client.other, server.other = server, client
        self.connections += [client, server]
        on_connection(server)
        return client

    def break_all(self) -> None:
        """Drop every open connection, as a crash or a partition would."""
        for conn in self.connections:
            conn.abort()
        self.connections.clear()
