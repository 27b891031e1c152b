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

With `keep_base=True` the receiver keeps the bytes of the version it applied last (the buffers its
tensors view: no copy, but they are not reused while kept) and says so (`Holding.base`,
`VersionAck.base`), so the publisher may send the next version as deltas against them
(`rollart.weights.delta`); a delta bucket is decoded into a buffer of its own. A delta against
bytes it does not keep ends the connection like a bad bucket, and the publisher, told again what
it keeps, sends whole versions.

A push that names a group (`Push.group`, `transport: nccl`) brings each payload by broadcast over that group
(`rollart.weights.collective`) instead of as a bulk frame; the receiver joins it at the push and keeps it while
pushes name it. Every manifest's MAC (`wire.manifest_mac`, keyed with the run's secret, which the receiver knows
through `relay_as`) is checked where it carries one, and required on a group's push, whose bytes come outside the
authenticated connection.

One piece: the receiver's connections, buckets in flight, delta bases and the version handed to the
engine are one state, changed by TCP and UCX alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
import torch

from rollart.protocol.auth import Identity, server_handshake
from rollart.protocol.bulk import open_bulk
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, HandshakeRefused, ProtocolError
from rollart.protocol.framing import Connection, TcpConnection
from rollart.protocol.messages import Hello
from rollart.protocol.tls import NodeTls
from rollart.weights import delta as deltas
from rollart.weights import ucx
from rollart.weights.buckets import VersionAssembly, unpack_bucket
from rollart.weights.collective import Group, GroupFailed
from rollart.weights.pool import BufferPool
from rollart.weights.relay import Relay
from rollart.weights.wire import (
    WEIGHTS,
    BucketManifest,
    ChecksumMismatch,
    DeltaBaseMissing,
    GroupTicket,
    Holding,
    Hop,
    ManifestForged,
    Push,
    VersionAck,
    WeightFormatError,
    manifest_mac,
)

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
    """Payload bytes that arrived (deltas as sent)."""
    bytes_decoded: int = 0
    """What they make as whole buckets: more than `bytes_received` by what deltas saved."""
    deltas: int = 0
    """Versions applied that came (partly) as deltas."""
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


@dataclass
class _Bucket:
    """One checked bucket: its tensors, and the bytes they view (kept as a delta base)."""

    payload: memoryview
    tensors: dict[str, torch.Tensor]


@dataclass
class _Base:
    """The bytes of the version applied last, bucket by bucket: what deltas are decoded against."""

    version: int
    buckets: list[memoryview]

    def bucket(self, push: Push, manifest: BucketManifest) -> memoryview:
        where = f"version {manifest.version} bucket {manifest.index}"
        if push.base != self.version:
            raise DeltaBaseMissing(f"{where}: a delta against version {push.base}; this receiver keeps {self.version}")
        if manifest.index >= len(self.buckets) or len(self.buckets[manifest.index]) != manifest.nbytes:
            raise DeltaBaseMissing(f"{where}: a delta against a bucket of version {push.base} not of its size")
        return self.buckets[manifest.index]


class _Incoming:
    """One version arriving: each bucket is checked in a worker thread while the next one arrives."""

    def __init__(
        self,
        push: Push,
        relay: Relay | None,
        unpack: Callable[[Push, BucketManifest, memoryview], Awaitable[_Bucket]],
    ) -> None:
        self.push = push
        self.relay = relay
        self.done = False
        self.started = time.perf_counter()
        self._unpack = unpack
        self._assembly = VersionAssembly(push.version, push.count)
        self._checks: list[tuple[BucketManifest, asyncio.Task[_Bucket]]] = []
        self.payloads: list[memoryview] = []
        """After `finish`: every bucket's bytes, in order (a delta base to keep)."""
        self.had_delta = False

    def add(self, manifest: BucketManifest, payload: memoryview) -> None:
        if manifest.count != self.push.count:
            raise WeightFormatError(
                f"version {manifest.version} bucket {manifest.index}: says {manifest.count} buckets; "
                f"its push said {self.push.count}"
            )
        if self.relay is not None:
            self.relay.forward(manifest, payload)
        self.had_delta |= manifest.delta_nbytes > 0
        self._checks.append((manifest, asyncio.ensure_future(self._unpack(self.push, manifest, payload))))

    async def finish(self) -> dict[str, torch.Tensor]:
        """Every tensor of the version, checked, with the tied aliases; raises on a bad bucket."""
        payloads: dict[int, memoryview] = {}
        try:
            for manifest, check in self._checks:
                bucket = await check
                self._assembly.add(manifest, bucket.tensors)
                payloads[manifest.index] = bucket.payload
        finally:
            for _, check in self._checks:
                check.cancel()
            self._checks = []
        weights = self._assembly.finish()
        self._assembly = VersionAssembly(self.push.version, self.push.count)  # holds no tensor past this
        self.payloads = [payloads[i] for i in range(self.push.count)]
        for alias, name in self.push.tied:
            if name not in weights or alias in weights:
                raise WeightFormatError(f"version {self.push.version}: tied {alias!r} -> {name!r} does not fit")
            weights[alias] = weights[name]
        return weights


def _wrong_dtype(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """Why `weights` are not what a receiver of `dtype` takes ('' when they are)."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            return f"tensor {name!r} arrived as {tensor.dtype}"
    return ""


class WeightReceiver:
    """Assembles pushed versions and applies each whole one, newest only, one at a time."""

    def __init__(
        self,
        apply: ApplyWeights,
        *,
        version: int = 0,
        dtype: torch.dtype | None = None,
        keep_base: bool = False,
        shared: bool = False,
    ) -> None:
        """`shared`: buckets land in shared memory (`rollart.shm`), for an engine whose worker processes map a
        version where it lies (`GenerationBackend.shared_weights`)."""
        self._apply = apply
        self._dtype = dtype
        self._keep_base = keep_base
        self._base: _Base | None = None
        self._relay_as: tuple[Identity, bytes, SessionConfig] | None = None
        self._relay_tls: NodeTls | None = None
        self._apply_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._stats = ReceiverStats(version)
        self._pool = BufferPool(shared=shared)
        self._tg: asyncio.TaskGroup | None = None
        self._started = asyncio.Event()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._listener: Any = None
        self._ucx_conns: set[ucx.UcxConnection] = set()
        self._ucx_held = False
        self._handshake_timeout_s = 0.0
        self._group: Group | None = None
        """The collective group the last push named (`transport: nccl`), kept while pushes name it."""

    @property
    def version(self) -> int:
        """The latest version applied (the initial one until a push is applied)."""
        return self._stats.version

    @property
    def base(self) -> int:
        """The version whose bytes it keeps to decode deltas against; -1: none."""
        return self._base.version if self._base is not None else -1

    def stats(self) -> ReceiverStats:
        return ReceiverStats(**vars(self._stats))

    async def wait_version(self, version: int, *, timeout: float) -> None:
        """Return once `version` or a newer one is applied; `TimeoutError` past `timeout`."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: self._stats.version >= version)

    def relay_as(self, local: Identity, secret: bytes, cfg: SessionConfig, tls: NodeTls | None = None) -> None:
        """Pass versions on when a push says so (`Push.relay`), connecting to the next hop as `local`
        (over TLS when `tls` is given)."""
        self._relay_as = (local, secret, cfg)
        self._relay_tls = tls

    async def _dial(self, hop: Hop) -> Connection:
        if self._relay_as is None:
            raise ProtocolError("weights: asked to relay, but this receiver has no identity to relay as")
        local, secret, cfg = self._relay_as
        if hop.ucx_port and self._ucx_held:
            return await ucx.open_ucx(hop.host, hop.ucx_port, local=local, secret=secret, cfg=cfg)
        return await open_bulk(hop.host, hop.port, local=local, secret=secret, cfg=cfg, tls=self._relay_tls)

    async def on_bulk(self, conn: Connection, peer: Identity) -> None:
        """Serve one authenticated bulk connection until it closes (`SessionServer(on_bulk=...)`)."""
        if isinstance(conn, TcpConnection | ucx.UcxConnection):
            conn.bulk_sink = self._pool.take
        self._stats.connections += 1
        log.info("weights.connected", peer=peer.node, conn=conn.peer, version=self.version)
        conn.send(WEIGHTS.encode(Holding(self.version, self.base)))
        relays: dict[tuple[str, str, int, int], Relay] = {}
        try:
            await self._serve_pushes(conn, peer, relays)
        finally:
            for relay in relays.values():
                await relay.close()

    async def _serve_pushes(
        self, conn: Connection, peer: Identity, relays: dict[tuple[str, str, int, int], Relay]
    ) -> None:
        incoming: _Incoming | None = None
        group: Group | None = None
        while True:
            msg = WEIGHTS.decode(await conn.recv())
            if isinstance(msg, Push):
                if incoming is not None and not incoming.done:
                    self._stats.replaced += 1
                    log.info("weights.replaced", dropped=incoming.push.version, by=msg.version, peer=peer.node)
                relay = None
                if msg.relay:
                    hop = msg.relay[0]
                    key = (hop.name, hop.host, hop.port, hop.ucx_port)
                    if key not in relays:
                        relays[key] = Relay(hop, conn, self._dial)
                    relay = relays[key]
                    relay.begin(msgspec.structs.replace(msg, relay=msg.relay[1:]))
                group = None
                if msg.group is not None:
                    if relay is not None:
                        raise ProtocolError("weights: a push over a group is not relayed")
                    group = self._joined(msg.group)
                incoming = _Incoming(msg, relay, self._unpack)
                continue
            if not isinstance(msg, BucketManifest):
                raise ProtocolError(f"weights: expected a push or a bucket manifest; got {type(msg).__name__}")
            self._check_mac(msg, required=incoming is not None and incoming.push.group is not None)
            if group is not None:  # the one this connection's push named, whatever pushes on others name
                payload = await _by_group(group, msg, self._pool.take)
            else:
                payload = await conn.recv_bulk()
            self._stats.bytes_received += len(payload)
            self._stats.bytes_decoded += msg.nbytes
            if incoming is None or msg.version != incoming.push.version or incoming.done:
                raise WeightFormatError(f"bucket {msg.index} of version {msg.version} outside its push")
            incoming.add(msg, payload)
            del payload  # the buffer is free for reuse as soon as its tensors (and the relay) are done with it
            if msg.index == msg.count - 1:
                incoming.done = True
                conn.send(WEIGHTS.encode(await self._take(incoming)))

    def _joined(self, ticket: GroupTicket) -> Group:
        """The group `ticket` names: the one kept, or a new one joined (the one kept is let go)."""
        if self._group is not None and self._group.ticket.key == ticket.key and not self._group.broken:
            return self._group
        if self._group is not None:
            self._group.close("the trainer named another group")
            self._group = None
        try:
            self._group = Group.join(ticket)
        except GroupFailed as exc:
            raise ProtocolError(str(exc)) from exc
        log.info("weights.group_joined", key=ticket.key[:8], rank=ticket.rank, size=ticket.size, backend=ticket.backend)
        return self._group

    def _check_mac(self, manifest: BucketManifest, *, required: bool) -> None:
        """A manifest must carry the MAC the run's secret gives it, where this receiver knows the secret (it
        relays as the node it is) and the manifest has one or needs one."""
        if self._relay_as is None or not (manifest.mac or required):
            return
        if not hmac.compare_digest(manifest.mac, manifest_mac(self._relay_as[1], manifest)):
            raise ManifestForged(
                f"version {manifest.version} bucket {manifest.index}: its manifest's MAC is "
                + ("wrong" if manifest.mac else "missing")
            )

    async def _take(self, incoming: _Incoming) -> VersionAck:
        """Check a whole version and apply it, unless it is not newer; the ack to send back."""
        push = incoming.push
        if push.version <= self.version:
            self._stats.ignored += 1
            return VersionAck(push.version, self.version, base=self.base)
        weights = await incoming.finish()
        # Idle buffers kept: enough for the version being received while `apply` holds this one.
        self._pool.cap_bytes = max(self._pool.cap_bytes or 0, 2 * push.nbytes)
        self._stats.last_receive_s = time.perf_counter() - incoming.started
        if self._dtype is not None and (wrong := _wrong_dtype(weights, self._dtype)):
            self._stats.apply_failures += 1
            return VersionAck(push.version, self.version, f"{wrong}; this receiver takes {self._dtype}", base=self.base)
        error = await self._apply_version(push.version, weights)
        del weights  # unless `apply` kept them, these buffers can take the next version
        if not error and self.version == push.version:
            self._stats.deltas += incoming.had_delta
            if self._keep_base:
                self._base = _Base(push.version, incoming.payloads)
        incoming.payloads = []
        return VersionAck(push.version, self.version, error, base=self.base)

    async def _unpack(self, push: Push, manifest: BucketManifest, payload: memoryview) -> _Bucket:
        """Check one bucket (decoding it first if it is a delta); its tensors view its bytes."""
        if manifest.delta_nbytes:
            if len(payload) != manifest.delta_nbytes:
                raise WeightFormatError(
                    f"version {manifest.version} bucket {manifest.index}: a {len(payload)}-byte delta; "
                    f"its manifest says {manifest.delta_nbytes}"
                )
            if self._base is None:
                raise DeltaBaseMissing(f"version {manifest.version}: a delta, but this receiver keeps no version")
            base = self._base.bucket(push, manifest)
            whole = self._pool.take(manifest.nbytes)
            delta, payload = payload, whole
            await asyncio.to_thread(deltas.decode, delta, base, whole, manifest.delta_stride)
        try:
            if manifest.nbytes >= _THREAD_BYTES:
                tensors = await asyncio.to_thread(unpack_bucket, manifest, payload)
            else:
                tensors = unpack_bucket(manifest, payload)
        except ChecksumMismatch:
            self._stats.checksum_failures += 1
            raise
        return _Bucket(payload, tensors)

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
        """End UCX connections and `serve()`, then stop listening; leave the group (`transport: nccl`). TCP
        connections end with their SessionServer.

        The listener goes last, and only to `ucx.RUNTIME`, which closes it once UCX's progress thread
        has stopped: closing it while endpoints accepted from it lived let a connection request run
        its callback on freed memory (ucx's module docstring). Until then a connection that arrives
        is dropped at once (`_stopping`)."""
        self._stopping.set()
        if self._group is not None:
            self._group.close("the receiver closed")
            self._group = None
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


async def _by_group(group: Group, manifest: BucketManifest, take: Callable[[int], memoryview]) -> memoryview:
    """The payload `manifest` announces, received into a buffer from `take` by the broadcast it comes by; a failed
    group ends the connection (the trainer forms a new one)."""
    if manifest.delta_nbytes:
        raise WeightFormatError("weights: a delta over a group (groups carry whole buckets)")
    payload = take(manifest.nbytes)
    try:
        await group.broadcast(payload)
    except GroupFailed as exc:
        raise ConnectionClosed(f"weights group {group.ticket.key[:8]}: {exc}") from exc
    return payload


async def _handshakes_over(listener: Any, timeout: float) -> None:
    """Wait (at most `timeout`) for connections the listener is still setting up (ucxx exchanges
    tags, then calls `on_endpoint`, which drops them now): each holds the ucxx context, which
    `ucxx.reset()` then could not let go. ucxx announces no end of these; its count is polled."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while listener.active_clients:  # noqa: ASYNC110 - ucxx offers no event for it
                await asyncio.sleep(0.01)
