"""The trainer's end of weight sync: snapshot a version, push it to every generator in the background.

    publisher = WeightPublisher(identity, secret, cfg, run.trainer.weights)   # a WeightsSpec: transport, ...
    publisher.add_target("gen-0", host, session_port, ucx_port=port, dtype=torch.bfloat16, place="cluster-a/h1")
    tg.create_task(publisher.run())                                       # plans and runs the pushes
    stall_s = publisher.publish(step, model.state_dict())                 # plans the buckets and returns
    ...
    await publisher.close()

`publish` is the only thing the trainer waits for: it plans the buckets of each wire dtype its
targets asked for and returns; a packer thread copies (and casts) the tensors into bucket buffers
while the first buckets are already on their way (`snapshot`). The trainer must not change the
tensors it handed over before `wait_packed` (its next optimizer step); an export made for the push
needs no wait.

How is `run.trainer.weights` (`rollart.weights.config.WeightsSpec`), handed whole to the publisher.
Who gets what from whom is planned per round: every target that lacks the latest version and is
not in backoff joins a push. With `fanout="star"` each such target gets its own push from the
trainer; with `"relay"` the targets of one wire dtype form a chain ordered by `place` (cluster,
then host), the trainer pushes to its head only, and every hop forwards each bucket to the next as
it arrives (`relay`): the trainer's egress is one state dict whatever the number of generators.
Every hop's ack comes back on the trainer's connection to the head. A target that fails (cannot be
reached, refuses, dies mid-push) is retried with jittered exponential backoff; the hops a failed
relay stranded are planned into the next round at once, without it. Latest wins: a target still
receiving version n when n+2 is published gets n+2 next; n+1 is skipped, never queued.

With `delta` a target that keeps the bytes of the version before the latest (it says so:
`Holding.base`, `VersionAck.base`) gets each bucket as a delta against them where that is smaller
(`rollart.weights.delta`); those targets chain apart from the ones that get whole versions.
`link_bytes` and `link_whole_bytes` count what the generators' links carried and what whole
versions would have taken.

With `transport: "nccl"` a round's ready targets of one wire dtype form one push instead (`_push_group`): each
gets the push and the manifests over its own connection, and every bucket goes to all of them at once by one
broadcast over their group (`rollart.weights.collective`), kept while the same targets take the pushes. A failed
group push backs off the targets whose connection ended (died, restarted) and plans the others again at once.
Every manifest carries a MAC keyed with the run's secret (`wire.manifest_mac`).

A push's deadline scales with its bytes: `push_timeout_s` when set, else 30 s plus four times the
transfer time at the slowest rate measured so far (at first, an assumed 100 MiB/s). `stats()` says,
per target, what it holds and how far the push in flight has got.

One piece: one loop plans every round of pushes from the targets' state, which each push, ack and
failure changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from typing import TypeVar

import msgspec
import structlog
import torch

from rollart.errors import RollartError
from rollart.protocol.auth import Identity
from rollart.protocol.bulk import open_bulk
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ProtocolError
from rollart.protocol.framing import Connection, TcpConnection
from rollart.protocol.tls import NodeTls
from rollart.weights import ucx
from rollart.weights.collective import Group, Groups
from rollart.weights.config import Fanout, WeightsSpec
from rollart.weights.snapshot import Snapshot, SnapshotStore
from rollart.weights.targets import Target, TargetStats
from rollart.weights.wire import (
    WEIGHTS,
    BucketManifest,
    GroupTicket,
    Holding,
    RelayFailed,
    VersionAck,
    WeightMsg,
    manifest_mac,
)

log = structlog.get_logger("rollart.weights.publisher")

M = TypeVar("M", bound=WeightMsg)

_FIRST_RATE = 100 * 1024**2
"""Bytes per second assumed for a push's deadline until one has been measured (then: the slowest seen)."""
_DEADLINE_SLACK = 4.0
_DEADLINE_BASE_S = 30.0


class WeightPublisher:
    """Pushes published versions to every target, newest first, never making the trainer wait."""

    def __init__(
        self,
        local: Identity,
        secret: bytes,
        cfg: SessionConfig,
        settings: WeightsSpec | None = None,
        *,
        tls: NodeTls | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """`settings`: `run.trainer.weights` (None: its defaults). `tls`: connections to generators are TLS
        (UCX and NCCL, which do not encrypt, are then refused). `host`: where generators reach this process
        (`transport: nccl` groups meet there)."""
        settings = settings or WeightsSpec()
        transport, bucket_bytes = settings.transport, settings.bucket_bytes
        if tls is not None and transport in ("ucx", "nccl"):
            raise ValueError(f"weights: {transport} does not encrypt; with TLS use transport 'tcp' or 'auto'")
        if tls is not None:
            transport = "tcp"
        if transport == "ucx":
            ucx.import_ucxx()  # TransportUnavailable now, rather than at the first push
        self.local, self.cfg, self.bucket_bytes, self.transport = local, cfg, bucket_bytes, transport
        self.fanout: Fanout = settings.fanout
        self.push_timeout_s = settings.push_timeout_s
        self.last_stall_s = 0.0
        self.egress_bytes = 0
        """Payload bytes the trainer has sent, to every target together."""
        self.link_bytes = 0
        """Payload bytes the links to the generators carried (a bucket the trainer sends down a chain
        of N counts N times: every hop forwards it), counted as the trainer sends it."""
        self.link_whole_bytes = 0
        """What they would have carried had every bucket travelled whole (equal to `link_bytes`
        without deltas)."""
        self._rate = float(_FIRST_RATE)
        self._rate_measured: float | None = None
        self._secret = secret
        self._tls = tls
        self._targets: dict[str, Target] = {}
        self._store = SnapshotStore(bucket_bytes, delta=settings.delta)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._stopped = asyncio.Event()
        self._changed = asyncio.Condition()
        self._ucx_held = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing_conns: set[asyncio.Future[None]] = set()
        self.groups = Groups(host)
        """`transport: nccl`: the groups pushes broadcast over."""

    # -- targets ----------------------------------------------------------------------------------

    def add_target(
        self,
        name: str,
        host: str,
        port: int,
        ucx_port: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        place: str = "",
    ) -> None:
        """Push to the generator `name`: TCP to its session `port`, or UCX to `ucx_port` (its receiver's);
        floating-point weights in `dtype` (None: as published); `place` orders relay chains."""
        if name in self._targets:
            raise ValueError(f"target {name!r} is already added")
        kind = "nccl" if self.transport == "nccl" else "tcp"
        if self.transport == "ucx":
            if ucx_port is None:
                raise ValueError(f"transport 'ucx' needs target {name!r}'s ucx_port")
            kind = "ucx"
        elif self.transport == "auto" and ucx_port is not None:
            reason = ucx.ucx_unavailable()
            kind = "tcp" if reason else "ucx"
            if reason:
                log.warning("weights.ucx_unavailable", target=name, reason=reason)
        if kind != "ucx":
            ucx_port = None
        dtype_label = str(dtype).removeprefix("torch.") if dtype is not None else ""
        stats = TargetStats(name, kind, dtype_label)
        self._targets[name] = Target(host, port, ucx_port, dtype, place, stats, last_seq=max(0, self._store.seq - 1))
        self._wake.set()
        log.info("weights.target_added", target=name, host=host, port=ucx_port or port, via=kind, dtype=dtype_label)

    def remove_target(self, name: str) -> None:
        target = self._targets.pop(name)
        self._hang_up(target)

    def report_holding(self, name: str, version: int) -> None:
        """What a target said it holds, heard another way (its status): a restarted target that lost
        its version gets the latest again."""
        target = self._targets.get(name)
        if target is not None and not target.busy and version < target.settled:
            target.behind(version)
            self._wake.set()

    def stats(self) -> dict[str, TargetStats]:
        return {name: dataclasses.replace(t.stats) for name, t in self._targets.items()}

    # -- publishing -------------------------------------------------------------------------------

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor], *, owned: bool = False) -> float:
        """Plan `version` in every wire dtype a target asked for and return the seconds it took; packing
        and pushing run in the background (see `wait_packed`).

        `owned`: the caller never changes these tensors again (an export made for this push: a cast,
        a gather), so over TCP they are sent from their own memory, no copy, once checksummed."""
        t0 = time.perf_counter()
        dtypes = tuple(dict.fromkeys(t.dtype for t in self._targets.values())) or (None,)
        contiguous = any(t.stats.transport != "tcp" for t in self._targets.values())  # one buffer a bucket
        self._store.put(version, state_dict, dtypes, owned=owned, contiguous=contiguous)
        self.last_stall_s = time.perf_counter() - t0
        if (loop := self._loop) is not None:
            loop.call_soon_threadsafe(self._wake.set)
        return self.last_stall_s

    def wait_packed(self, timeout: float | None = None) -> float:
        """Block until the tensors of the last `publish` are no longer read; returns the seconds waited.
        Call before changing them (the next optimizer step); from any thread."""
        t0 = time.perf_counter()
        for snap in self._store.latest_all():
            if not snap.packed.wait(timeout):
                raise TimeoutError(f"weights of version {snap.version} still packing after {timeout} s")
        return time.perf_counter() - t0

    async def wait_delivered(self, version: int, *, timeout: float) -> None:
        """Return once every target holds `version` or newer; `TimeoutError` past `timeout`."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: all(t.stats.version >= version for t in self._targets.values()))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def deadline_s(self, nbytes: int, hops: int = 1) -> float:
        """How long a push of `nbytes` through `hops` generators may take before it counts as failed."""
        if self.push_timeout_s is not None:
            return self.push_timeout_s
        pipeline = nbytes + (hops - 1) * min(nbytes, self.bucket_bytes)
        return _DEADLINE_BASE_S + _DEADLINE_SLACK * pipeline / self._rate

    # -- the push loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Plan and run pushes until `close()`."""
        self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                while not self._closing.is_set():
                    self._wake.clear()
                    self._plan_round()
                    await self._sleep_until_due()
                await _cancel_all(list(self._tasks))
        finally:
            self._tg = None
            for target in self._targets.values():
                self._hang_up(target)
            await self._all_closed()
            self._store.close()
            self.groups.close()
            self._stopped.set()

    async def close(self) -> None:
        """Stop every push (one in progress is abandoned) and `run()`."""
        self._closing.set()
        self._wake.set()
        if self._loop is not None:
            await self._stopped.wait()
        if self._ucx_held:
            self._ucx_held = False
            ucx.RUNTIME.release()

    async def _sleep_until_due(self) -> None:
        now = time.monotonic()
        due = [t.retry_at - now for t in self._targets.values() if not t.busy and t.retry_at > now]
        wake = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait([wake], timeout=min(due, default=None))
        finally:
            wake.cancel()

    def _plan_round(self) -> None:
        """Start a push for every target that lacks its latest version and is neither busy nor in backoff."""
        assert self._tg is not None
        now = time.monotonic()
        groups: dict[tuple[torch.dtype | None, bool], list[Target]] = {}
        for target in self._targets.values():
            snap = self._store.latest(target.dtype)
            if snap is None or target.busy or target.retry_at > now:
                continue
            if target.settled < snap.version:
                delta = self.transport != "nccl" and snap.base_version >= 0 and target.base == snap.base_version
                groups.setdefault((target.dtype, delta), []).append(target)
        for (dtype, delta), ready in groups.items():
            ready.sort(key=lambda t: (t.place, t.host, t.stats.name))
            grouped = self.transport == "nccl"
            chains = [ready] if self.fanout == "relay" or grouped else [[t] for t in ready]
            for chain in chains:
                snap = self._store.take_latest(dtype)
                assert snap is not None
                for target in chain:
                    target.busy = True
                push = self._push_group(chain, snap) if grouped else self._push_chain(chain, snap, delta=delta)
                task = self._tg.create_task(push, name=f"weights->{chain[0].stats.name}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _push_chain(self, chain: list[Target], snap: Snapshot, *, delta: bool) -> None:
        """Push `snap` to the chain's head, which relays it down the rest; settle every member."""
        head = chain[0]
        waiting = {t.stats.name: t for t in chain}
        try:
            await _stop_watching(head)
            if head.stats.transport == "ucx" and not self._ucx_held:
                ucx.RUNTIME.acquire()
                self._ucx_held = True
            if head.conn is None or head.conn.closed:
                await self._connect(head)
            if len(chain) == 1 and snap.version <= head.settled:
                waiting.clear()
                return
            assert head.conn is not None
            await self._push(chain, snap, head.conn, waiting, delta=delta)
            head.attempt = 0
        except (OSError, TimeoutError, RollartError) as exc:
            self._failed(head, exc)
            waiting.pop(head.stats.name, None)
            self._hang_up(head)
        finally:
            for target in chain:
                target.busy = False
                target.stats.in_flight = None
                target.stats.via = ""
            for target in waiting.values():  # stranded by a failed head or relay: the next round replans them
                if target.settled < snap.version:
                    log.info("weights.replan", target=target.stats.name, version=snap.version)
            self._store.drop(snap)
            if head.conn is not None and head.watch is None and not self._closing.is_set():
                head.watch = asyncio.ensure_future(self._watch_idle(head, head.conn))
            self._wake.set()
            await self._notify()

    async def _connect(self, t: Target) -> None:
        conn: Connection
        cfg = self.cfg
        self._hang_up(t)
        if t.stats.transport == "ucx":
            assert t.ucx_port is not None
            conn = await ucx.open_ucx(t.host, t.ucx_port, local=self.local, secret=self._secret, cfg=cfg)
        else:
            conn = await open_bulk(t.host, t.port, local=self.local, secret=self._secret, cfg=cfg, tls=self._tls)
        try:
            async with asyncio.timeout(cfg.handshake_timeout_s):
                holding = await _recv(conn, Holding)
        except BaseException:
            conn.close()
            raise
        t.conn = conn
        t.connected(holding)
        await self._notify()

    async def _push(
        self, chain: list[Target], snap: Snapshot, conn: Connection, waiting: dict[str, Target], *, delta: bool
    ) -> None:
        head = chain[0]
        members = {t.stats.name: t for t in chain}
        for target in chain:
            target.stats.in_flight = snap.version
            target.stats.via = "trainer" if target is head else chain[chain.index(target) - 1].stats.name
        s = head.stats
        s.progress_bytes, s.progress_of = 0, snap.nbytes
        sent = 0
        t0 = time.perf_counter()
        async with asyncio.timeout(self.deadline_s(snap.nbytes, len(chain))):
            conn.send(WEIGHTS.encode(snap.push_header(tuple(t.hop() for t in chain[1:]), delta=delta)))
            for index, plan in enumerate(snap.plans):
                manifest, parts = await snap.bucket(index, delta=delta)
                conn.send(WEIGHTS.encode(self._signed(manifest)))
                await _send_payload(conn, parts)
                nbytes = manifest.delta_nbytes or plan.nbytes
                s.progress_bytes += plan.nbytes
                s.bytes_sent += nbytes
                sent += nbytes
                self.egress_bytes += nbytes
                self.link_bytes += nbytes * len(chain)
                self.link_whole_bytes += plan.nbytes * len(chain)
            while waiting:
                msg = WEIGHTS.decode(await conn.recv())
                if isinstance(msg, RelayFailed):
                    self._relay_failed(msg, snap, members, waiting)
                    continue
                if not isinstance(msg, VersionAck):
                    raise ProtocolError(f"weights: expected an ack from {s.name}; got {type(msg).__name__}")
                acked = members.get(msg.node or s.name)
                if acked is None or msg.version != snap.version:
                    raise ProtocolError(
                        f"weights: ack for {msg.node or s.name} version {msg.version}; sent {snap.version}"
                    )
                acked.acked(msg, snap, time.perf_counter() - t0, relayed=acked is not head, delta=delta)
                waiting.pop(acked.stats.name, None)
        rate = (sent + (len(chain) - 1) * min(sent, self.bucket_bytes)) / (time.perf_counter() - t0)
        self._rate = rate if self._rate_measured is None else min(self._rate_measured, rate)
        self._rate_measured = self._rate

    def _signed(self, manifest: BucketManifest) -> BucketManifest:
        return msgspec.structs.replace(manifest, mac=manifest_mac(self._secret, manifest))

    async def _push_group(self, members: list[Target], snap: Snapshot) -> None:
        """Push `snap` to every member at once: one broadcast per bucket over their group (`transport: nccl`),
        the push, the manifests and the acks over each one's connection."""
        waiting = {t.stats.name: t for t in members}
        group: Group | None = None
        try:
            for target in members:
                await _stop_watching(target)
            connected = await asyncio.gather(*(self._connected(t) for t in members), return_exceptions=True)
            for target, outcome in zip(members, connected, strict=True):
                if isinstance(outcome, BaseException):
                    if not isinstance(outcome, OSError | TimeoutError | RollartError):
                        raise outcome
                    self._failed(target, outcome)
                    self._hang_up(target)
                    waiting.pop(target.stats.name)
                elif snap.version <= target.settled:
                    waiting.pop(target.stats.name)
            if not waiting:
                return
            joined = list(waiting.values())
            timeout_s = self.deadline_s(snap.nbytes)
            group, tickets = self.groups.group_for(tuple(t.stats.name for t in joined), timeout_s=timeout_s)
            await self._broadcast(joined, snap, group, tickets, waiting)
        except (OSError, TimeoutError, RollartError) as exc:
            await self._group_failed(list(waiting.values()), group, exc)
            waiting.clear()  # the culprits are backing off; the others are planned again at once
        finally:
            for target in members:
                target.busy = False
                target.stats.in_flight = None
                target.stats.via = ""
            self._store.drop(snap)
            for target in members:
                if target.conn is not None and target.watch is None and not self._closing.is_set():
                    target.watch = asyncio.ensure_future(self._watch_idle(target, target.conn))
            self._wake.set()
            await self._notify()

    async def _connected(self, target: Target) -> None:
        if target.conn is None or target.conn.closed:
            await self._connect(target)

    async def _broadcast(
        self, joined: list[Target], snap: Snapshot, group: Group, tickets: list[GroupTicket], waiting: dict[str, Target]
    ) -> None:
        conns = [target.conn for target in joined]
        for target in joined:
            target.stats.in_flight, target.stats.via = snap.version, "trainer"
            target.stats.progress_bytes, target.stats.progress_of = 0, snap.nbytes
        t0 = time.perf_counter()
        async with asyncio.timeout(self.deadline_s(snap.nbytes)):
            for conn, ticket in zip(conns, tickets, strict=True):
                assert conn is not None
                conn.send(WEIGHTS.encode(msgspec.structs.replace(snap.push_header(), group=ticket)))
            for index, plan in enumerate(snap.plans):
                manifest, parts = await snap.bucket(index)
                frame = WEIGHTS.encode(self._signed(manifest))
                for conn in conns:
                    assert conn is not None
                    conn.send(frame)
                await group.broadcast(parts[0] if len(parts) == 1 else memoryview(b"".join(parts)))
                self.egress_bytes += plan.nbytes
                self.link_bytes += plan.nbytes * len(joined)
                self.link_whole_bytes += plan.nbytes * len(joined)
                for target in joined:
                    target.stats.progress_bytes += plan.nbytes
                    target.stats.bytes_sent += plan.nbytes
            acks = await asyncio.gather(*(_recv(conn, VersionAck) for conn in conns if conn is not None))
        seconds = time.perf_counter() - t0
        for target, ack in zip(joined, acks, strict=True):
            if ack.version != snap.version or ack.node:
                got = f"ack for version {ack.version} from {target.stats.name}"
                raise ProtocolError(f"weights: {got}; sent {snap.version}")
            target.acked(ack, snap, seconds, relayed=False, delta=False)
            waiting.pop(target.stats.name, None)
        self._rate = min(self._rate_measured or float("inf"), snap.nbytes / seconds)
        self._rate_measured = self._rate

    async def _group_failed(self, members: list[Target], group: Group | None, exc: BaseException) -> None:
        """A group push failed: whoever's connection ended is the cause and backs off (a member that died or
        restarted); with none ended, all of them do. Every member hangs up and the group is not used again, so
        the next round forms one of the members still there."""
        conns = [t.conn for t in members if t.conn is not None and not t.conn.closed]
        if conns and not any(t.conn is None or t.conn.closed for t in members):
            # A member that died shows in its connection a moment after the broadcast to it failed.
            ended = [asyncio.ensure_future(conn.wait_closed()) for conn in conns]
            await asyncio.wait(ended, timeout=self.cfg.handshake_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in ended:
                waiter.cancel()
        culprits = [t for t in members if t.conn is None or t.conn.closed] or members
        if group is not None:
            self.groups.discard(group, f"{type(exc).__name__}: {exc}")
        for target in members:
            if target in culprits:
                self._failed(target, exc)
            else:
                log.info("weights.replan", target=target.stats.name, version=target.stats.in_flight, why=str(exc))
            self._hang_up(target)

    def _relay_failed(
        self, msg: RelayFailed, snap: Snapshot, members: dict[str, Target], waiting: dict[str, Target]
    ) -> None:
        if msg.version != snap.version:
            return
        failed = members.get(msg.node)
        if failed is not None and waiting.pop(msg.node, None) is not None:
            self._failed(failed, RollartError(f"relayed to by another generator: {msg.error}"))
        for name in msg.unreached:
            waiting.pop(name, None)  # not its fault: planned again next round

    def _failed(self, t: Target, exc: BaseException) -> None:
        t.failed(exc, self.cfg)

    def _hang_up(self, t: Target, *, watcher: bool = True) -> None:
        if watcher and t.watch is not None:
            t.watch.cancel()
            t.watch = None
        if t.conn is not None:
            t.conn.close()
            closing = asyncio.ensure_future(t.conn.wait_closed())
            self._closing_conns.add(closing)
            closing.add_done_callback(self._closing_conns.discard)
            t.conn = None
        t.stats.connected = False

    async def _all_closed(self) -> None:
        """Wait for every connection hung up to be closed: a UCX endpoint still closing would keep
        the ucxx context alive past `ucx.RUNTIME.release()`, whose reset then fails."""
        if self._closing_conns:
            await asyncio.wait(list(self._closing_conns), timeout=5.0)

    async def _watch_idle(self, t: Target, conn: Connection) -> None:
        """While no push uses it (a push cancels this first), a connection that closes (a restarted
        target) or speaks is ended; the next round connects again and learns what the target holds."""
        try:
            await conn.recv()
            raise ProtocolError(f"weights: target {t.stats.name} sent a frame while idle")
        except (OSError, RollartError) as exc:
            if t.conn is conn:
                log.info("weights.target_hung_up", target=t.stats.name, error=str(exc))
                self._hang_up(t, watcher=False)
                t.settled = -1  # connect again to learn what it holds
                self._wake.set()
        finally:
            if t.watch is asyncio.current_task():
                t.watch = None


async def _stop_watching(target: Target) -> None:
    """End the idle watch on `target`'s connection before a push uses it, and let the cancelled receive finish now:
    its cleanup (TcpConnection clears its waiter) would otherwise run later and drop the waiter of the push's ack."""
    if (watch := target.watch) is not None:
        target.watch = None
        watch.cancel()
        await asyncio.wait([watch])


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait for them, cancelling again any that carries on.

    A cancellation can be lost: on Python 3.11 `asyncio.wait_for` returns the inner result when it
    completes in the same loop turn as the cancel (ucxx's `create_endpoint` awaits it), and the push
    loop would then retry as if nothing happened."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)


async def _send_payload(conn: Connection, parts: list[memoryview]) -> None:
    if isinstance(conn, TcpConnection):
        await conn.send_bulk_parts(parts)
    elif len(parts) == 1:
        await conn.send_bulk(parts[0])
    else:  # a UCX target added after an owned version was planned for TCP alone: one copy
        await conn.send_bulk(b"".join(parts))


async def _recv(conn: Connection, kind: type[M]) -> M:
    msg = WEIGHTS.decode(await conn.recv())
    if not isinstance(msg, kind):
        raise ProtocolError(f"weights: expected {kind.__name__}; got {type(msg).__name__}")
    return msg
