"""A TCP forwarder in front of a node that can cut the network between roles (a partition).

It forwards bytes both ways and reads the client's first frame, the session `Hello`, to learn
which role is connecting. While the partition is on, nothing moves between the forwarder and a
connection from a cut-off role, in either direction: bytes are held, as a real partition holds
them in TCP retransmissions, so neither side sees a reset, only silence (its heartbeat deadline
decides). Connections opened meanwhile are accepted and held the same way. When the partition
heals, what was held is delivered and forwarding goes on; a side that gave up meanwhile has closed
its socket, and the close reaches the other side after the data.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

import msgspec

from rollart.protocol.messages import DECODE_ERRORS, Hello

_LEN = struct.Struct(">I")


class PartitionProxy:
    """Forwards `listen_port` to `target_port` on loopback; `cut(roles)` partitions those roles off."""

    def __init__(self, listen_port: int, target_port: int, host: str = "127.0.0.1") -> None:
        self.listen_port, self.target_port, self.host = listen_port, target_port, host
        self.cut_roles: frozenset[str] = frozenset()
        self._healed = asyncio.Event()
        self._healed.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self.connections = 0
        self.held_bytes = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.listen_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    def cut(self, roles: set[str]) -> None:
        """Hold everything to and from connections of these roles until `heal`."""
        self.cut_roles = frozenset(roles)
        self._healed.clear()

    def heal(self) -> None:
        self.cut_roles = frozenset()
        self._healed.set()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            header = await client_r.readexactly(_LEN.size)
            (length,) = _LEN.unpack(header)
            # TLS's first record (a ClientHello: 0x16 0x03 ...) hides the Hello: forward it unread, roleless.
            body = b"" if header[:2] == b"\x16\x03" else await client_r.readexactly(min(length, 64 * 1024))
        except (asyncio.IncompleteReadError, ConnectionError):
            client_w.close()
            return
        role = ""
        with contextlib.suppress(msgspec.ValidationError, *DECODE_ERRORS):
            role = msgspec.msgpack.decode(body, type=Hello).role
        try:
            server_r, server_w = await asyncio.open_connection(self.host, self.target_port)
        except OSError:  # the node is down: the client sees its connection closed, as without us
            client_w.close()
            return
        first = header + body
        for source, sink, preface in ((client_r, server_w, first), (server_r, client_w, b"")):
            pump = asyncio.ensure_future(self._pump(role, source, sink, preface))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(self, role: str, source: asyncio.StreamReader, sink: asyncio.StreamWriter, data: bytes) -> None:
        try:
            while True:
                if data:
                    while role in self.cut_roles:  # partitioned: hold the bytes until it heals
                        self.held_bytes += len(data)
                        await self._healed.wait()
                    sink.write(data)
                    await sink.drain()
                data = await source.read(256 * 1024)
                if not data:
                    while role in self.cut_roles:  # the close, too, waits for the network
                        await self._healed.wait()
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            sink.close()
