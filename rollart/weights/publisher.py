"""The trainer's end of weight sync: snapshot a version, push it to every generator in the background.

    publisher = WeightPublisher(identity, secret, cfg)           # transport "auto": UCX where it can, else TCP
    publisher.add_target("gen-0", host, session_port, ucx_port=port_from_generator)
    tg.create_task(publisher.run())                               # owns one push task per target
    stall_s = publisher.publish(step, model.state_dict())         # copies into bucket buffers, returns
    ...
    await publisher.close()

`publish` is the only thing the trainer waits for: it copies the tensors into bucket buffers (the
optimizer changes the originals next step) and returns. Each target's task pushes on its own
schedule, so a slow or dead generator delays nobody else. Latest wins: a target still receiving
version n when n+2 is published gets n+2 next; n+1 is skipped, never queued. A target that cannot
be reached is retried with jittered exponential backoff, and gets the newest version when it is
back. `publish` may be called from a worker thread (e.g. the training step's), one caller at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Mapping
from typing import Literal, TypeVar

import structlog
import torch

from rollart.errors import RollartError
from rollart.protocol.auth import Identity
from rollart.protocol.bulk import open_bulk
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ProtocolError
from rollart.protocol.framing import Connection
from rollart.weights import ucx
from rollart.weights.buckets import DEFAULT_BUCKET_BYTES, byte_view
from rollart.weights.snapshot import Snapshot, SnapshotStore
from rollart.weights.wire import WEIGHTS, Holding, VersionAck, WeightMsg

log = structlog.get_logger("rollart.weights.publisher")

Transport = Literal["auto", "tcp", "ucx"]
M = TypeVar("M", bound=WeightMsg)


@dataclasses.dataclass
class TargetStats:
    name: str
    transport: str
    version: int = -1
    """The version the target holds, as it last said (-1: not heard from yet)."""
    pushes: int = 0
    last_push_s: float = 0.0
    """First byte sent to acknowledgement, of the last push (includes the target's `apply`)."""
    last_push_bytes: int = 0
    bytes_sent: int = 0
    failures: int = 0
    skipped: int = 0
    """Published versions this target never got because a newer one was ready first."""
    in_flight: int | None = None
    connected: bool = False
    last_error: str = ""


@dataclasses.dataclass(eq=False)
class _Target:
    host: str
    port: int
    ucx_port: int | None
    stats: TargetStats
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    settled: int = -1
    """Newest version not to push again: the one it holds, or one it refused."""
    last_seq: int = 0
    task: asyncio.Task[None] | None = None


class WeightPublisher:
    """Pushes published versions to every target, newest first, never making the trainer wait."""

    def __init__(
        self,
        local: Identity,
        secret: bytes,
        cfg: SessionConfig,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        transport: Transport = "auto",
        push_timeout_s: float = 120.0,
    ) -> None:
        if transport == "ucx":
            ucx.import_ucxx()  # TransportUnavailable now, rather than at the first push
        self.local, self.cfg, self.bucket_bytes, self.transport = local, cfg, bucket_bytes, transport
        self.push_timeout_s = push_timeout_s
        self.last_stall_s = 0.0
        self._secret = secret
        self._targets: dict[str, _Target] = {}
        self._store = SnapshotStore(bucket_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._closing = asyncio.Event()
        self._stopped = asyncio.Event()
        self._changed = asyncio.Condition()
        self._ucx_held = False

    def add_target(self, name: str, host: str, port: int, ucx_port: int | None = None) -> None:
        """Push to the generator `name`: TCP to its session `port`, or UCX to `ucx_port` (its receiver's)."""
        if name in self._targets:
            raise ValueError(f"target {name!r} is already added")
        kind = "tcp"
        if self.transport == "ucx":
            if ucx_port is None:
                raise ValueError(f"transport 'ucx' needs target {name!r}'s ucx_port")
            kind = "ucx"
        elif self.transport == "auto" and ucx_port is not None:
            reason = ucx.ucx_unavailable()
            kind = "tcp" if reason else "ucx"
            if reason:
                log.warning("weights.ucx_unavailable", target=name, reason=reason)
        target = _Target(host, port, ucx_port, TargetStats(name, kind), last_seq=max(0, self._store.seq - 1))
        self._targets[name] = target
        if self._tg is not None:
            target.task = self._tg.create_task(self._serve(target), name=f"weights->{name}")
        log.info("weights.target_added", target=name, host=host, port=ucx_port if kind == "ucx" else port, via=kind)

    def remove_target(self, name: str) -> None:
        target = self._targets.pop(name)
        if target.task is not None:
            target.task.cancel()

    def stats(self) -> dict[str, TargetStats]:
        return {name: dataclasses.replace(t.stats) for name, t in self._targets.items()}

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> float:
        """Snapshot `state_dict` as `version` and return the seconds it took; the pushes run in the background."""
        t0 = time.perf_counter()
        self._store.put(version, state_dict)
        self.last_stall_s = time.perf_counter() - t0
        if (loop := self._loop) is not None:
            loop.call_soon_threadsafe(self._wake_all)
        return self.last_stall_s

    def _wake_all(self) -> None:
        for target in self._targets.values():
            target.wake.set()

    async def wait_delivered(self, version: int, *, timeout: float) -> None:
        """Return once every target holds `version` or newer; `TimeoutError` past `timeout`."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: all(t.stats.version >= version for t in self._targets.values()))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def run(self) -> None:
        """Run every target's push task until `close()`."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for name, target in self._targets.items():
                    target.task = tg.create_task(self._serve(target), name=f"weights->{name}")
                await self._closing.wait()
                await _cancel_all([t.task for t in self._targets.values() if t.task is not None])
        finally:
            self._tg = None
            self._stopped.set()

    async def close(self) -> None:
        """Stop every push (one in progress is abandoned) and `run()`."""
        self._closing.set()
        if self._loop is not None:
            await self._stopped.wait()
        if self._ucx_held:
            self._ucx_held = False
            ucx.RUNTIME.release()

    async def _serve(self, t: _Target) -> None:
        """One target, forever: connect, push the latest version it lacks, idle until the next one."""
        if t.stats.transport == "ucx" and not self._ucx_held:
            ucx.RUNTIME.acquire()
            self._ucx_held = True
        conn: Connection | None = None
        attempt = 0
        try:
            # Checked as well as cancelled: a cancellation can be lost (`_cancel_all`).
            while self._targets.get(t.stats.name) is t and not self._closing.is_set():
                t.wake.clear()  # before reading the latest: a publish after this read wakes the wait below
                snap, delay = self._store.take_latest(), 0.0
                try:
                    if snap is None or (conn is not None and snap.version <= t.settled):
                        await self._idle(t, conn)
                        continue
                    if conn is None:
                        conn = await self._connect(t)
                    if snap.version > t.settled:
                        await self._push(t, conn, snap)
                    attempt = 0
                except (OSError, TimeoutError, RollartError) as exc:
                    t.stats.failures += 1
                    t.stats.last_error = f"{type(exc).__name__}: {exc}"
                    delay = random.uniform(0, min(self.cfg.backoff_cap_s, self.cfg.backoff_base_s * 2**attempt))
                    attempt += 1
                    log.warning("weights.push_failed", target=t.stats.name, error=t.stats.last_error, attempt=attempt)
                    if conn is not None:
                        conn.close()
                        conn, t.stats.connected = None, False
                finally:
                    if snap is not None:
                        self._store.drop(snap)
                if delay:
                    await asyncio.sleep(delay)
        finally:
            if conn is not None:
                conn.close()
            t.stats.connected = False

    async def _idle(self, t: _Target, conn: Connection | None) -> None:
        """Wait to be woken; the connection closing (or saying anything) ends the wait with an error."""
        waits: list[asyncio.Future[object]] = [asyncio.ensure_future(t.wake.wait())]
        if conn is not None:
            waits.append(asyncio.ensure_future(conn.recv()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            # Let the cancelled receive finish now: its cleanup (TcpConnection clears its waiter) would
            # otherwise run later and drop the waiter of the next receive, the push's acknowledgement.
            await asyncio.wait(waits)
        if len(waits) > 1 and not waits[1].cancelled():
            waits[1].result()  # ConnectionClosed: the target went away (restarted?)
            raise ProtocolError(f"weights: target {t.stats.name} sent a frame while idle")

    async def _connect(self, t: _Target) -> Connection:
        conn: Connection
        cfg = self.cfg
        if t.stats.transport == "ucx":
            assert t.ucx_port is not None
            conn = await ucx.open_ucx(t.host, t.ucx_port, local=self.local, secret=self._secret, cfg=cfg)
        else:
            conn = await open_bulk(t.host, t.port, local=self.local, secret=self._secret, cfg=cfg)
        try:
            async with asyncio.timeout(cfg.handshake_timeout_s):
                holding = await _recv(conn, Holding)
        except BaseException:
            conn.close()
            raise
        t.stats.connected, t.stats.version, t.settled = True, holding.version, holding.version
        log.info("weights.connected", target=t.stats.name, holds=holding.version, via=t.stats.transport)
        await self._notify()
        return conn

    async def _push(self, t: _Target, conn: Connection, snap: Snapshot) -> None:
        t.stats.in_flight = snap.version
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.push_timeout_s):
                for index, buffer in enumerate(snap.buffers):
                    conn.send(WEIGHTS.encode(await snap.manifest(index)))
                    await conn.send_bulk(byte_view(buffer))
                ack = await _recv(conn, VersionAck)
        finally:
            t.stats.in_flight = None
        seconds = time.perf_counter() - t0
        if ack.version != snap.version:
            raise ProtocolError(
                f"weights: target {t.stats.name} acknowledged version {ack.version}; sent {snap.version}"
            )
        s = t.stats
        s.version, t.settled = ack.holding, max(ack.holding, snap.version)
        if ack.error:
            s.failures += 1
            s.last_error = f"version {snap.version} refused: {ack.error}"
            log.error("weights.refused", target=s.name, version=snap.version, error=ack.error)
        else:
            s.pushes, s.last_push_s, s.last_push_bytes = s.pushes + 1, seconds, snap.nbytes
            s.bytes_sent += snap.nbytes
            s.skipped += max(0, snap.seq - t.last_seq - 1)
            t.last_seq = snap.seq
            log.info(
                "weights.pushed", target=s.name, version=snap.version, seconds=round(seconds, 4), bytes=snap.nbytes
            )
        await self._notify()


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait for them, cancelling again any that carries on.

    A cancellation can be lost: on Python 3.11 `asyncio.wait_for` returns the inner result when it
    completes in the same loop turn as the cancel (ucxx's `create_endpoint` awaits it), and the push
    loop would then retry as if nothing happened."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)


async def _recv(conn: Connection, kind: type[M]) -> M:
    msg = WEIGHTS.decode(await conn.recv())
    if not isinstance(msg, kind):
        raise ProtocolError(f"weights: expected {kind.__name__}; got {type(msg).__name__}")
    return msg
