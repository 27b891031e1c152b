"""The generator's end of weight sync: receive buckets, check them, hand each whole version to the engine.

    receiver = WeightReceiver(engine.load_weights)
    server = SessionServer(..., on_bulk=receiver.on_bulk)            # TCP: pushes arrive on the session port
    tg.create_task(receiver.serve())                                  # UCX: owns the endpoint tasks
    ucx_port = await receiver.listen_ucx(local=me, secret=secret, cfg=cfg)   # tell the trainer this port

Each bucket's payload lands in a buffer of its own (`bulk_sink`), its CRC-32 is checked, and its
tensors are views into that buffer. When the last bucket of a version is in, `apply(version,
tensors)` runs and the publisher gets a `VersionAck`. A buffer is reused only once no tensor made
from it is left (`pool.BufferPool`), so `apply` may keep the tensors (the transformers engine
copies them in later); an `apply` that lets go of them spares the next version's receive the page
faults of fresh memory (~4x). A version not newer than the applied one is acknowledged and
dropped; a newer version arriving while an older one is half received replaces it. A bad bucket
(checksum, format) ends the connection: the publisher resends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from rollart.protocol.auth import Identity, server_handshake
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, HandshakeRefused, ProtocolError
from rollart.protocol.framing import Connection, TcpConnection
from rollart.protocol.messages import Hello
from rollart.weights import ucx
from rollart.weights.buckets import VersionAssembly, unpack_bucket
from rollart.weights.pool import BufferPool
from rollart.weights.wire import WEIGHTS, BucketManifest, ChecksumMismatch, Holding, VersionAck, WeightFormatError

log = structlog.get_logger("rollart.weights.receiver")

_THREAD_BYTES = 1024 * 1024  # check buckets at least this big in a worker thread, off the event loop


@dataclass
class ReceiverStats:
    version: int
    """Latest version applied."""
    applied: int = 0
    ignored: int = 0
    """Whole versions that arrived but were not newer than the applied one."""
    replaced: int = 0
    """Half-received versions dropped because a newer one started arriving."""
    bytes_received: int = 0
    last_receive_s: float = 0.0
    """First bucket in to last bucket checked, of the last version applied."""
    last_apply_s: float = 0.0
    """How long `apply` took for the last version applied."""
    apply_failures: int = 0
    """Whole versions that `apply` raised on (the error goes back to the publisher in the ack)."""
    checksum_failures: int = 0
    """Buckets whose CRC-32 did not match (the connection ends; the publisher resends)."""
    connections: int = 0
    """Bulk connections served, TCP and UCX."""
    refusals: int = 0
    """UCX connections that failed the handshake (TCP refusals are counted by the SessionServer)."""


ApplyWeights = Callable[[int, dict[str, torch.Tensor]], Awaitable[None]]
"""What `WeightReceiver` hands each whole version to: `apply(version, tensors)` (an engine's `load_weights`)."""


class WeightReceiver:
    """Assembles pushed versions and applies each whole one, newest only, one at a time."""

    def __init__(self, apply: ApplyWeights, *, version: int = 0) -> None:
        self._apply = apply
        self._apply_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._stats = ReceiverStats(version)
        self._pool = BufferPool()
        self._tg: asyncio.TaskGroup | None = None
        self._started = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._listener: Any = None
        self._ucx_conns: set[ucx.UcxConnection] = set()
        self._ucx_held = False
        self._handshake_timeout_s = 0.0

    @property
    def version(self) -> int:
        """The latest version applied (the initial one until a push is applied)."""
        return self._stats.version

    def stats(self) -> ReceiverStats:
        return ReceiverStats(**vars(self._stats))

    async def wait_version(self, version: int, *, timeout: float) -> None:
        """Return once `version` or a newer one is applied; `TimeoutError` past `timeout`."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self._stats.version >= version)

    async def on_bulk(self, conn: Connection, peer: Identity) -> None:
        """Serve one authenticated bulk connection until it closes (`SessionServer(on_bulk=...)`)."""
        if isinstance(conn, TcpConnection | ucx.UcxConnection):
            conn.bulk_sink = self._pool.take
        self._stats.connections += 1
        log.info("weights.connected", peer=peer.node, conn=conn.peer, version=self.version)
        conn.send(WEIGHTS.encode(Holding(self.version)))
        partial: VersionAssembly | None = None
        started = 0.0
        while True:
            manifest = WEIGHTS.decode(await conn.recv())
            if not isinstance(manifest, BucketManifest):
                raise ProtocolError(f"weights: expected a bucket manifest; got {type(manifest).__name__}")
            payload = await conn.recv_bulk()
            self._stats.bytes_received += len(payload)
            last = manifest.index == manifest.count - 1
            if manifest.version <= self.version:
                if last:
                    self._stats.ignored += 1
                    conn.send(WEIGHTS.encode(VersionAck(manifest.version, self.version)))
                continue
            if partial is None or manifest.version > partial.version:
                if partial is not None:
                    self._stats.replaced += 1
                    log.info("weights.replaced", dropped=partial.version, by=manifest.version, peer=peer.node)
                partial, started = VersionAssembly(manifest.version, manifest.count), time.perf_counter()
            elif manifest.version < partial.version:
                raise WeightFormatError(f"bucket of version {manifest.version} after version {partial.version} began")
            partial.add(manifest, await self._unpack(manifest, payload))
            del payload  # the buffer is free for reuse as soon as its tensors are gone
            if last:
                weights = partial.finish()
                # Idle buffers kept: enough for the version being received while `apply` holds this one.
                self._pool.cap_bytes = max(self._pool.cap_bytes or 0, 2 * partial.nbytes)
                partial = None
                self._stats.last_receive_s = time.perf_counter() - started
                error = await self._apply_version(manifest.version, weights)
                del weights  # unless `apply` kept them, these buffers can take the next version
                conn.send(WEIGHTS.encode(VersionAck(manifest.version, self.version, error)))

    async def _unpack(self, manifest: BucketManifest, payload: memoryview) -> dict[str, torch.Tensor]:
        try:
            if manifest.nbytes >= _THREAD_BYTES:
                return await asyncio.to_thread(unpack_bucket, manifest, payload)
            return unpack_bucket(manifest, payload)
        except ChecksumMismatch:
            self._stats.checksum_failures += 1
            raise

    async def _apply_version(self, version: int, weights: dict[str, torch.Tensor]) -> str:
        """Apply unless something newer got there first; returns the error to report, or ''."""
        async with self._apply_lock:
            if version <= self.version:
                self._stats.ignored += 1
                return ""
            t0 = time.perf_counter()
            try:
                await self._apply(version, weights)
            except Exception as exc:  # the engine refused these weights: reported to the publisher, logged here
                self._stats.apply_failures += 1
                log.exception("weights.apply_failed", version=version)
                return f"{type(exc).__name__}: {exc}"
            self._stats.last_apply_s = time.perf_counter() - t0
            self._stats.applied += 1
            self._stats.version = version
        log.info("weights.applied", version=version, apply_s=round(self._stats.last_apply_s, 4))
        async with self._changed:
            self._changed.notify_all()
        return ""

    # -- UCX ------------------------------------------------------------------------------------

    async def serve(self) -> None:
        """Own the UCX connections' tasks until `close()` (not needed for TCP-only use)."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._started.set()
                await self._stopping.wait()
                for conn in list(self._ucx_conns):
                    conn.close()
        finally:
            self._stopped.set()

    async def listen_ucx(self, *, local: Identity, secret: bytes, cfg: SessionConfig, port: int = 0) -> int:
        """Accept UCX pushes on `port` (0: any free one), on every interface; returns the port.

        Call after `serve()` has started. Raises `TransportUnavailable` when ucxx cannot load."""
        await self._started.wait()
        if self._listener is not None:
            raise RuntimeError("this receiver already listens for UCX")
        if not self._ucx_held:
            ucx.RUNTIME.acquire()
            self._ucx_held = True

        def on_endpoint(ep: Any) -> None:
            if self._tg is None or self._stopping.is_set():
                return  # ucxx closes an endpoint nobody keeps
            self._tg.create_task(self._serve_ucx(ep, local, secret, cfg))

        self._handshake_timeout_s = cfg.handshake_timeout_s
        self._listener = ucx.listen_ucx(on_endpoint, port=port, timeout=cfg.handshake_timeout_s)
        port = int(self._listener.port)
        log.info("weights.ucx_listening", port=port)
        return port

    async def _serve_ucx(self, ep: Any, local: Identity, secret: bytes, cfg: SessionConfig) -> None:
        conn = ucx.UcxConnection(ep, "ucx-peer", max_frame_bytes=cfg.max_frame_bytes, max_bulk_bytes=cfg.max_bulk_bytes)
        self._ucx_conns.add(conn)

        def lookup(hello: Hello) -> tuple[str, bool, int]:
            if hello.purpose != "bulk":
                raise ProtocolError(f"the UCX weights port takes bulk connections; got purpose {hello.purpose!r}")
            return "ucx", False, 0

        try:
            hello = await server_handshake(
                conn, identity=local, secret=secret, lookup=lookup, timeout=cfg.handshake_timeout_s
            )
            conn.authenticated()
            await self.on_bulk(conn, Identity(hello.node, hello.role))
        except HandshakeRefused:
            self._stats.refusals += 1
        except ConnectionClosed as exc:  # the publisher went away or closed: it reconnects when it needs to
            log.info("weights.ucx_connection_ended", error=str(exc))
        except ProtocolError as exc:  # a bad bucket or frame: the publisher sees the close and resends
            log.warning("weights.ucx_connection_failed", error=str(exc))
        finally:
            conn.close()
            await conn.wait_closed()
            self._ucx_conns.discard(conn)

    async def close(self) -> None:
        """End UCX connections and `serve()`, then stop listening. TCP connections end with their SessionServer.

        The listener goes last, and only to `ucx.RUNTIME`, which closes it once UCX's progress thread
        has stopped: closing it while endpoints accepted from it lived let a connection request run
        its callback on freed memory (ucx's module docstring). Until then a connection that arrives
        is dropped at once (`_stopping`)."""
        self._stopping.set()
        for conn in list(self._ucx_conns):
            conn.close()
        if self._started.is_set():
            await self._stopped.wait()
        if self._listener is not None:
            listener, self._listener = self._listener, None
            await _handshakes_over(listener, self._handshake_timeout_s)
            ucx.RUNTIME.retire(listener)
        if self._ucx_held:
            self._ucx_held = False
            ucx.RUNTIME.release()


async def _handshakes_over(listener: Any, timeout: float) -> None:
    """Wait (at most `timeout`) for connections the listener is still setting up (ucxx exchanges
    tags, then calls `on_endpoint`, which drops them now): each holds the ucxx context, which
    `ucxx.reset()` then could not let go. ucxx announces no end of these; its count is polled."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while listener.active_clients:  # noqa: ASYNC110 - ucxx offers no event for it
                await asyncio.sleep(0.01)
