"""Weight pushes over real loopback, to receivers in their own processes, over TCP, over UCX (ucxx) and by
broadcast over a collective group (`transport: nccl`, gloo here):
a slow receiver skips to the newest version, one that is down gets the newest when it comes up,
one that restarts gets the latest again, a publisher with the wrong secret is refused; relayed
down a chain of four, every receiver ends with the same bytes and the trainer sends one copy, and
a relay killed mid-push strands nobody behind it.

Each receiver process (multiprocessing, spawn) runs a `SessionServer` whose `on_bulk` is the
`WeightReceiver`'s, plus its UCX listener; it checks every tensor it is given against the values
the test publishes for that version and reports what it applied (and a CRC-32C of what it got)
through a pipe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection as Pipe
from typing import Any

import pytest
import torch

from rollart.protocol import CONTROL, Identity, Session, SessionConfig, SessionServer
from rollart.weights.buckets import byte_view, checksum, plan_buckets
from rollart.weights.config import Fanout, Transport, WeightsSpec
from rollart.weights.publisher import WeightPublisher
from rollart.weights.receiver import WeightReceiver
from rollart.weights.ucx import ucx_unavailable
from tests.support import free_ports

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
SECRET = b"weights integration secret"
TRAINER = Identity("trainer", "trainer")
CFG = SessionConfig(handshake_timeout_s=1.0, backoff_base_s=0.05, backoff_cap_s=0.3)
BUCKET_BYTES = 256 * 1024
UCX_MISSING = ucx_unavailable()
TRANSPORTS = [
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(UCX_MISSING is not None, reason=f"UCX transport: {UCX_MISSING}")),
    "nccl",  # a gloo group here (no CUDA): the same code as NCCL's but for the backend
]
RELAYED = TRANSPORTS[:2]
"""The transports a relay chain runs over (a group push reaches every generator at once, relaying nothing)."""


def weights(version: int, rows: int = 256) -> dict[str, torch.Tensor]:
    """What the test publishes as `version`: ~1.2 MB in 5 buckets, three dtypes (more `rows`: bigger)."""
    return {
        "model.embed_tokens.weight": torch.full((rows, 1024), float(version)),
        "model.norm.weight": torch.full((64,), float(version), dtype=torch.bfloat16),
        "model.positions": torch.arange(1000, dtype=torch.int64) + version,
        "lm_head.weight": torch.full((32, 1024), -float(version)),
    }


# -- the receiver process ----------------------------------------------------------------------------


class _NoMessages:
    async def on_event(self, session: Session, msg: Any) -> None:
        raise AssertionError(f"unexpected event {msg!r}")

    async def on_request(self, session: Session, msg: Any) -> Any:
        raise AssertionError(f"unexpected request {msg!r}")


def crc_of(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        crc = checksum(byte_view(tensors[name].contiguous().reshape(-1).view(torch.uint8)), crc)
    return crc


@dataclasses.dataclass(frozen=True)
class Options:
    """How a receiver process behaves: its apply's delay, the size of what it expects, whether it
    keeps a delta base."""

    apply_delay_s: float = 0.0
    rows: int = 256
    keep_base: bool = False


async def _serve(pipe: Pipe, name: str, ports: tuple[int, int | None], options: Options) -> None:
    applied: list[int] = []
    crcs: list[int] = []
    intact = True

    async def apply(version: int, received: dict[str, torch.Tensor]) -> None:
        nonlocal intact
        expected = weights(version, options.rows)
        intact = intact and received.keys() == expected.keys()
        intact = intact and all(torch.equal(received[name], tensor) for name, tensor in expected.items())
        applied.append(version)
        crcs.append(crc_of(received))
        await asyncio.sleep(options.apply_delay_s)  # a generator busy swapping weights in

    me = Identity(name, "generator")
    port, ucx_port = ports
    receiver = WeightReceiver(apply, keep_base=options.keep_base)
    receiver.relay_as(me, SECRET, CFG)
    server = SessionServer(
        local=me, secret=SECRET, channel=CONTROL, handler=_NoMessages(), cfg=CFG, on_bulk=receiver.on_bulk
    )
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[str | None] = asyncio.Queue()

    def readable() -> None:
        try:
            requests.put_nowait(pipe.recv())
        except EOFError:  # the parent closed its end (or died): stop
            loop.remove_reader(pipe.fileno())
            requests.put_nowait(None)

    loop.add_reader(pipe.fileno(), readable)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(server.serve())
        tg.create_task(receiver.serve())
        await server.listen_tcp(HOST, port)
        if ucx_port is not None:
            await receiver.listen_ucx(local=me, secret=SECRET, cfg=CFG, port=ucx_port)
        pipe.send(os.getpid())
        while await requests.get() == "stats":
            refusals = server.refusals + receiver.stats().refusals
            deltas = receiver.stats().deltas
            pipe.send(
                {"applied": list(applied), "intact": intact, "refusals": refusals, "crcs": list(crcs), "deltas": deltas}
            )
        await receiver.close()
        await server.close()


def receiver_main(pipe: Pipe, name: str, ports: tuple[int, int | None], options: Options) -> None:
    asyncio.run(_serve(pipe, name, ports, options))


class ReceiverProcess:
    def __init__(self, name: str, transport: str, ports: tuple[int, int], options: Options) -> None:
        self.port, ucx_port = ports
        self.ucx_port = ucx_port if transport == "ucx" else None
        ctx = multiprocessing.get_context("spawn")
        self.pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=receiver_main,
            args=(theirs, name, (self.port, self.ucx_port), options),
            name=f"weights-receiver-{name}",
        )
        self.proc.start()
        theirs.close()

    async def _reply(self, timeout: float) -> Any:
        if not await asyncio.to_thread(self.pipe.poll, timeout):
            raise AssertionError(f"receiver process silent for {timeout} s (exit code {self.proc.exitcode})")
        return self.pipe.recv()

    async def ready(self) -> None:
        assert await self._reply(30) == self.proc.pid

    async def stats(self) -> dict[str, Any]:
        self.pipe.send("stats")
        reply: dict[str, Any] = await self._reply(10)
        return reply

    async def stop(self, *, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        self.pipe.close()
        await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join)


class Receivers:
    """Starts receiver processes; stops whatever is left of them at teardown."""

    def __init__(self) -> None:
        self.procs: list[ReceiverProcess] = []
        self._ports: dict[str, tuple[int, int]] = {}

    def ports_of(self, name: str = "gen-0") -> tuple[int, int]:
        """(session port, UCX port) of receiver `name`: the same each time it is started."""
        if name not in self._ports:
            port, ucx_port = free_ports(2)
            self._ports[name] = (port, ucx_port)
        return self._ports[name]

    @property
    def ports(self) -> tuple[int, int]:
        return self.ports_of("gen-0")

    async def start(
        self,
        transport: str,
        apply_delay_s: float = 0.0,
        *,
        name: str = "gen-0",
        rows: int = 256,
        keep_base: bool = False,
    ) -> ReceiverProcess:
        proc = ReceiverProcess(name, transport, self.ports_of(name), Options(apply_delay_s, rows, keep_base))
        self.procs.append(proc)
        await proc.ready()
        return proc


@pytest.fixture
async def receivers() -> AsyncIterator[Receivers]:
    started = Receivers()
    try:
        yield started
    finally:
        for proc in started.procs:
            if proc.proc.is_alive():
                await proc.stop(kill=True)


def publisher_for(
    transport: Transport,
    receivers: Receivers,
    secret: bytes = SECRET,
    *,
    names: tuple[str, ...] = ("gen-0",),
    fanout: Fanout = "star",
    delta: bool = False,
) -> WeightPublisher:
    settings = WeightsSpec(bucket_mb=BUCKET_BYTES / (1 << 20), transport=transport, fanout=fanout, delta=delta)
    publisher = WeightPublisher(TRAINER, secret, CFG, settings)
    for name in names:
        port, ucx_port = receivers.ports_of(name)
        publisher.add_target(name, HOST, port, ucx_port=ucx_port if transport == "ucx" else None)
    return publisher


async def until(condition: Callable[[], bool], timeout: float) -> None:
    """Poll a condition no event announces (another process's state), for at most `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - the publisher's stats change without an event to wait on
            await asyncio.sleep(0.01)


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_slow_receiver_skips_to_the_newest_version(transport: Transport, receivers: Receivers) -> None:
    proc = await receivers.start(transport, apply_delay_s=0.3)
    publisher = publisher_for(transport, receivers)
    async with asyncio.timeout(40), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        stalls = [publisher.publish(1, weights(1))]
        started = lambda s=publisher.stats: s()["gen-0"].in_flight == 1 or s()["gen-0"].version >= 1  # noqa: E731
        await until(started, timeout=20)
        for version in range(2, 6):  # while version 1 is still being applied
            stalls.append(publisher.publish(version, weights(version)))
            await asyncio.sleep(0)
        await publisher.wait_delivered(5, timeout=20)
        await publisher.close()
    report = await proc.stats()
    assert report["applied"] == [1, 5]  # 2, 3 and 4 skipped, never queued; nothing older after newer
    assert report["intact"]
    stats = publisher.stats()["gen-0"]
    assert (stats.version, stats.pushes, stats.skipped, stats.failures) == (5, 2, 3, 0)
    assert stats.transport == transport
    assert stats.last_push_bytes == sum(plan.nbytes for plan in plan_buckets(weights(5), BUCKET_BYTES))
    assert max(stalls) < 0.2  # the copy only: never the 0.3 s the receiver takes per version


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_receiver_that_is_down_gets_the_newest_version_when_it_comes_up(
    transport: Transport, receivers: Receivers
) -> None:
    publisher = publisher_for(transport, receivers)
    async with asyncio.timeout(40), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        for version in (1, 2, 3):
            publisher.publish(version, weights(version))
            failures = publisher.stats()["gen-0"].failures
            await until(lambda: publisher.stats()["gen-0"].failures > failures, timeout=10)  # noqa: B023
        proc = await receivers.start(transport)
        await publisher.wait_delivered(3, timeout=20)
        await publisher.close()
    report = await proc.stats()
    assert report["applied"] == [3]
    assert report["intact"]
    assert publisher.stats()["gen-0"].failures >= 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_restarted_receiver_gets_the_latest_version_again(transport: Transport, receivers: Receivers) -> None:
    first = await receivers.start(transport)
    publisher = publisher_for(transport, receivers)
    async with asyncio.timeout(40), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        publisher.publish(7, weights(7))
        await publisher.wait_delivered(7, timeout=20)
        await first.stop(kill=True)  # while the publisher idles on its connection
        second = await receivers.start(transport)
        applied: list[int] = []
        async with asyncio.timeout(20):
            while not applied:
                applied = (await second.stats())["applied"]
                await asyncio.sleep(0.05)
        await publisher.close()
    assert applied == [7]
    assert publisher.stats()["gen-0"].pushes == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_publisher_with_the_wrong_secret_is_refused(transport: Transport, receivers: Receivers) -> None:
    proc = await receivers.start(transport)
    publisher = publisher_for(transport, receivers, secret=b"not the secret")
    async with asyncio.timeout(40), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        publisher.publish(1, weights(1))
        await until(lambda: publisher.stats()["gen-0"].failures >= 2, timeout=20)
        await publisher.close()
    stats = publisher.stats()["gen-0"]
    assert "wrong shared secret" in stats.last_error
    assert stats.version == -1 and stats.pushes == 0
    report = await proc.stats()
    assert report["applied"] == []
    assert report["refusals"] >= 2


# -- relay ---------------------------------------------------------------------------------------------

CHAIN = ("gen-0", "gen-1", "gen-2", "gen-3")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", RELAYED)
async def test_a_relay_chain_of_4_ends_with_identical_checksums(transport: Transport, receivers: Receivers) -> None:
    procs = [await receivers.start(transport, name=name) for name in CHAIN]
    publisher = publisher_for(transport, receivers, names=CHAIN, fanout="relay")
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        for version in (1, 2, 3):
            publisher.publish(version, weights(version), owned=True)  # over TCP: sent from the tensors themselves
            await publisher.wait_delivered(version, timeout=30)
        await publisher.close()
    sent = crc_of(weights(3))
    for proc in procs:
        report = await proc.stats()
        assert report["applied"] == [1, 2, 3] and report["intact"]
        assert report["crcs"][-1] == sent
    stats = publisher.stats()
    state_bytes = sum(plan.nbytes for plan in plan_buckets(weights(3), BUCKET_BYTES))
    assert publisher.egress_bytes == 3 * state_bytes  # one copy per version, whatever the chain's length
    assert [stats[name].bytes_sent for name in CHAIN] == [3 * state_bytes, 0, 0, 0]
    assert [stats[name].relayed for name in CHAIN] == [0, 3, 3, 3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["tcp", "nccl"], ids=["relay", "nccl_transport"])
async def test_kill_9_of_a_generator_mid_push_and_every_other_one_converges(
    transport: Transport, receivers: Receivers
) -> None:
    """Over TCP the one killed relays the version down a chain (gen-0 -> gen-1 -> gen-2 -> gen-3); by a group
    (transport nccl) it is one of the members of the broadcast. Either way the others get the version without
    counting a failure, and the killed one gets it once it is back."""
    rows = 16384  # 64 MiB a version, in 256 KiB buckets: long enough to kill a generator in the middle of it
    names = CHAIN if transport == "tcp" else CHAIN[:3]
    procs = {name: await receivers.start(transport, name=name, rows=rows) for name in names}
    publisher = publisher_for(transport, receivers, names=names, fanout="relay")
    others = [name for name in names if name != "gen-1"]
    async with asyncio.timeout(100), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        publisher.publish(1, weights(1, rows))
        await until(lambda: publisher.stats()["gen-0"].progress_bytes > 0, timeout=20)
        await procs["gen-1"].stop(kill=True)
        await until(lambda: all(publisher.stats()[name].version >= 1 for name in others), timeout=60)
        stats = publisher.stats()
        assert stats["gen-1"].version < 1 and stats["gen-1"].failures >= 1
        assert all(stats[name].failures == 0 for name in others)  # the dead one is the cause, not them
        procs["gen-1"] = await receivers.start(transport, name="gen-1", rows=rows)  # back: it gets the version too
        await publisher.wait_delivered(1, timeout=60)
        await publisher.close()
    for proc in procs.values():
        report = await proc.stats()
        assert report["applied"] == [1] and report["intact"]
        assert report["crcs"] == [crc_of(weights(1, rows))]


@pytest.mark.timeout(120)
async def test_delta_versions_relayed_down_a_chain_and_a_restarted_hop_gets_a_whole_one(receivers: Receivers) -> None:
    procs = {name: await receivers.start("tcp", name=name, keep_base=True) for name in CHAIN}
    publisher = publisher_for("tcp", receivers, names=CHAIN, fanout="relay", delta=True)
    async with asyncio.timeout(100), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        for version in (1, 2, 3):
            publisher.publish(version, weights(version))
            await publisher.wait_delivered(version, timeout=30)
        assert publisher.link_bytes < publisher.link_whole_bytes / 2  # version 1 whole, 2 and 3 as deltas
        await procs["gen-2"].stop(kill=True)
        procs["gen-2"] = await receivers.start("tcp", name="gen-2", keep_base=True)  # back, keeping no version
        for version in (4, 5):
            publisher.publish(version, weights(version))
            await publisher.wait_delivered(version, timeout=60)
        await publisher.close()
    reports = {name: await proc.stats() for name, proc in procs.items()}
    for name, report in reports.items():
        assert report["intact"] and report["crcs"][-1] == crc_of(weights(5)), name
    for name in ("gen-0", "gen-1", "gen-3"):
        assert reports[name]["applied"] == [1, 2, 3, 4, 5] and reports[name]["deltas"] == 4, reports[name]
    # The restarted hop refused the delta of version 4 (no base), got it whole, then version 5 as a delta.
    assert reports["gen-2"]["applied"] == [4, 5] and reports["gen-2"]["deltas"] == 1, reports["gen-2"]
    assert publisher.stats()["gen-2"].failures >= 1


# -- collective groups (transport: nccl; gloo here) --------------------------------------------------

GROUP = ("gen-0", "gen-1", "gen-2")


@pytest.mark.timeout(90)
async def test_nccl_transport_broadcasts_each_bucket_once_to_every_generator(receivers: Receivers) -> None:
    procs = [await receivers.start("nccl", name=name) for name in GROUP]
    publisher = publisher_for("nccl", receivers, names=GROUP)
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        for version in (1, 2, 3):
            publisher.publish(version, weights(version), owned=version == 2)  # an export's own memory too
            await publisher.wait_delivered(version, timeout=30)
        await publisher.close()
    for proc in procs:
        report = await proc.stats()
        assert report["applied"] == [1, 2, 3] and report["intact"]
        assert report["crcs"][-1] == crc_of(weights(3))
    state_bytes = sum(plan.nbytes for plan in plan_buckets(weights(3), BUCKET_BYTES))
    assert publisher.egress_bytes == 3 * state_bytes  # one broadcast a bucket, whatever the number of generators
    assert publisher.groups.formed == 1  # the same generators every time: one group
    stats = publisher.stats()
    assert {stats[name].transport for name in GROUP} == {"nccl"}
    assert all(stats[name].pushes == 3 and stats[name].failures == 0 for name in GROUP)


@pytest.mark.timeout(90)
async def test_nccl_transport_a_generator_that_joins_later_gets_the_latest_in_a_new_group(receivers: Receivers) -> None:
    procs = [await receivers.start("nccl", name=name) for name in GROUP[:2]]
    publisher = publisher_for("nccl", receivers, names=GROUP[:2])
    async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
        tg.create_task(publisher.run())
        publisher.publish(1, weights(1))
        await publisher.wait_delivered(1, timeout=30)
        procs.append(await receivers.start("nccl", name=GROUP[2]))
        publisher.add_target(GROUP[2], HOST, receivers.ports_of(GROUP[2])[0])
        await publisher.wait_delivered(1, timeout=30)  # the newcomer gets the latest, alone
        publisher.publish(2, weights(2))
        await publisher.wait_delivered(2, timeout=30)  # then all three together
        await publisher.close()
    reports = [await proc.stats() for proc in procs]
    assert [report["applied"] for report in reports] == [[1, 2], [1, 2], [1, 2]]
    assert all(report["intact"] for report in reports)
    assert publisher.groups.formed == 3  # the first two; the newcomer alone; all three
