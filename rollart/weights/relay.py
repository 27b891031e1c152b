"""Relaying: a generator passes each bucket it receives on to the next generator of its chain.

    relay = Relay(hop, up=conn_from_upstream, dialer=dial)   # one per upstream connection and next hop
    relay.begin(push)              # a version starts: announce it (and the rest of the chain) downstream
    relay.forward(manifest, payload)   # as soon as a bucket is in, before it is checked here
    relay.close()

The trainer sends each bucket once, to the head of a chain; every hop forwards it while it
receives the next, so a chain of N delivers the last byte about (N - 1) buckets after a single
push would, and the trainer's egress is one state dict. The acks of every hop behind this one come
back on the downstream connection and are passed up, named; when the next hop cannot be reached or
fails mid-push, `RelayFailed` names it and the hops behind it, and the trainer pushes to those
again (from itself or by another chain). Payloads are forwarded as received (each hop checks the
trainer's CRC-32C itself), from the receive buffer: no copy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import msgspec
import structlog

from rollart.errors import RollartError
from rollart.protocol.errors import ProtocolError
from rollart.protocol.framing import Connection
from rollart.weights.wire import WEIGHTS, BucketManifest, Holding, Hop, Push, RelayFailed, VersionAck

log = structlog.get_logger("rollart.weights.relay")

Dial = Callable[[Hop], Awaitable[Connection]]
"""Opens an authenticated bulk connection to a hop (TCP or UCX)."""

_Item = Push | tuple[BucketManifest, memoryview]


class Relay:
    """Forwards versions from one upstream connection to one next hop; acks go back up."""

    def __init__(self, hop: Hop, up: Connection, dial: Dial) -> None:
        self.hop = hop
        self._up = up
        self._dial = dial
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._push: Push | None = None
        """The version being passed on (its relay: the hops after `hop`)."""
        self._failed_version = -1
        self.bytes_sent = 0
        self._task = asyncio.create_task(self._run(), name=f"relay->{hop.name}")

    def begin(self, push: Push) -> None:
        """`push` (whose `relay` is the rest of the chain after `hop`) starts: pass it on."""
        self._queue.put_nowait(push)

    def forward(self, manifest: BucketManifest, payload: memoryview) -> None:
        self._queue.put_nowait((manifest, payload))

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        conn: Connection | None = None
        reader: asyncio.Task[None] | None = None
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, Push):
                    self._push = item
                elif self._push is None or item[0].version != self._push.version:
                    continue  # a bucket of a version that failed to start here
                if self._push.version == self._failed_version:
                    continue  # the rest of a version this hop already failed
                try:
                    if conn is None or conn.closed:
                        if reader is not None:
                            reader.cancel()
                        conn = await self._dial(self.hop)
                        async with asyncio.timeout(10):
                            held = WEIGHTS.decode(await conn.recv())
                        if not isinstance(held, Holding):
                            raise ProtocolError(f"relay: {self.hop.name} opened with {type(held).__name__}")
                        reader = asyncio.create_task(self._pass_back(conn), name=f"relay<-{self.hop.name}")
                    if isinstance(item, Push):
                        conn.send(WEIGHTS.encode(item))
                    else:
                        manifest, payload = item
                        conn.send(WEIGHTS.encode(manifest))
                        await conn.send_bulk(payload)
                        self.bytes_sent += len(payload)
                except (OSError, TimeoutError, RollartError) as exc:
                    self._fail(f"{type(exc).__name__}: {exc}")
                    if conn is not None:
                        conn.close()
                    conn = None
                del item  # a forwarded payload's receive buffer is free once its tensors are too
        finally:
            if reader is not None:
                reader.cancel()
            if conn is not None:
                conn.close()

    def _fail(self, error: str) -> None:
        """Tell upstream that the version being passed on did not get past `hop`."""
        push = self._push
        if push is None or push.version == self._failed_version:
            return
        self._failed_version = push.version
        log.warning("weights.relay_failed", version=push.version, to=self.hop.name, error=error)
        unreached = tuple(hop.name for hop in push.relay)
        with contextlib.suppress(RollartError):
            self._up.send(WEIGHTS.encode(RelayFailed(push.version, self.hop.name, error, unreached)))

    async def _pass_back(self, conn: Connection) -> None:
        """Pass the downstream's acks (its own, named, and those it passes back) up."""
        try:
            while True:
                msg = WEIGHTS.decode(await conn.recv())
                if isinstance(msg, VersionAck) and not msg.node:
                    msg = msgspec.structs.replace(msg, node=self.hop.name)
                elif not isinstance(msg, VersionAck | RelayFailed):
                    raise ProtocolError(f"relay: {self.hop.name} sent {type(msg).__name__}")
                self._up.send(WEIGHTS.encode(msg))
        except (OSError, RollartError) as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            conn.close()
