"""Delta sync: a bucket as zstd of its XOR with the version before, byte-shuffled; made by the snapshot
store's packer, decoded by a receiver that keeps the bytes of the version it applied last."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from rollart.protocol import Identity, MemoryConnection, MemoryNetwork
from rollart.weights.buckets import byte_view, unpack_bucket
from rollart.weights.delta import decode, encode, stride_of
from rollart.weights.receiver import WeightReceiver
from rollart.weights.snapshot import Snapshot, SnapshotStore
from rollart.weights.wire import WEIGHTS, DeltaBaseMissing, Holding, Push, VersionAck, WeightFormatError


def adam_step(weights: torch.Tensor, lr: float, seed: int) -> torch.Tensor:
    """`weights` moved by about `lr` each, as one AdamW step moves them."""
    sign = torch.randn(weights.shape, generator=torch.Generator().manual_seed(seed)).sign()
    return weights + lr * sign


def as_bytes(tensor: torch.Tensor) -> memoryview:
    return byte_view(tensor.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_of_an_optimizer_step_is_smaller_and_decodes_to_the_exact_bytes(dtype: torch.dtype) -> None:
    before = (torch.randn(100_003, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    after = adam_step(before.float(), 1e-4, seed=1).to(dtype)
    encoded = encode(as_bytes(after), as_bytes(before), stride=dtype.itemsize)
    assert encoded is not None and len(encoded) < 0.7 * after.numel() * dtype.itemsize
    out = bytearray(after.numel() * dtype.itemsize)
    decode(memoryview(encoded), as_bytes(before), memoryview(out), stride=dtype.itemsize)
    assert bytes(out) == bytes(as_bytes(after))  # 100,003 elements: the shuffle's tail is handled


def test_delta_that_saves_nothing_is_not_sent() -> None:
    gen = torch.Generator().manual_seed(0)
    before, after = (torch.randint(0, 256, (200_000,), generator=gen, dtype=torch.uint8) for _ in range(2))
    assert encode(as_bytes(after), as_bytes(before), stride=4) is None  # random bytes do not compress
    assert encode(as_bytes(after), as_bytes(before[:10]), stride=4) is None  # not the same bucket


def test_a_delta_that_does_not_decode_to_its_bucket_is_refused() -> None:
    base = torch.zeros(1000)
    encoded = encode(as_bytes(torch.ones(1000)), as_bytes(base), stride=4)
    assert encoded is not None
    with pytest.raises(WeightFormatError, match="does not decompress"):
        decode(memoryview(b"not zstd at all"), as_bytes(base), memoryview(bytearray(4000)), stride=4)
    with pytest.raises(WeightFormatError, match="cannot make"):
        decode(memoryview(encoded), as_bytes(base), memoryview(bytearray(4004)), stride=4)
    with pytest.raises(WeightFormatError, match="decompresses to 4000 bytes"):
        decode(memoryview(encoded), as_bytes(torch.zeros(2000)), memoryview(bytearray(8000)), stride=4)
    with pytest.raises(WeightFormatError, match="stride 0"):
        decode(memoryview(encoded), as_bytes(base), memoryview(bytearray(4000)), stride=0)


def test_the_shuffle_stride_is_the_first_floating_point_tensors_element_size() -> None:
    store = SnapshotStore(1 << 20)
    [snap] = store.put(1, {"ids": torch.arange(3), "w": torch.ones(4, dtype=torch.bfloat16)})
    assert stride_of(snap.plans[0].entries) == 2
    assert stride_of(snap.plans[0].entries[:1]) == 1  # integers only: not shuffled
    store.close()


def state(version: int) -> dict[str, torch.Tensor]:
    """A small state dict that one optimizer step per version moves (three buckets of 64 KiB)."""
    gen = torch.Generator().manual_seed(0)
    weights = {f"layer.{i}.weight": torch.randn(4096, generator=gen) * 0.02 for i in range(3)}
    weights["steps"] = torch.tensor(version)
    return {
        name: adam_step(t, 1e-4 * version, seed=version) if t.is_floating_point() else t for name, t in weights.items()
    }


async def test_delta_snapshots_encode_against_the_version_before_and_decode_to_it() -> None:
    store = SnapshotStore(64 * 1024, delta=True)
    [first] = store.put(1, state(1))
    assert store.take_latest() is first  # a push of it keeps its buffers for this test to read
    [second] = store.put(2, state(2))
    second.packed.wait()
    assert (first.base_version, second.base_version) == (-1, 1)
    for index in range(len(second.plans)):
        manifest, parts = await second.bucket(index, delta=True)
        whole, _ = await second.bucket(index)
        if manifest.delta_nbytes:
            out = bytearray(manifest.nbytes)
            decode(parts[0], byte_view(first.buffers[index]), memoryview(out), manifest.delta_stride)
            assert bytes(out) == bytes(byte_view(second.buffers[index]))
        unpack_bucket(whole, byte_view(second.buffers[index]))  # the whole bucket checks as ever
    saved = [(await second.bucket(i, delta=True))[0].delta_nbytes for i in range(len(second.plans))]
    assert all(saved[:3]), saved  # the three weight buckets travel as deltas
    store.drop(first)
    store.close()


class Engine:
    def __init__(self) -> None:
        self.applied: dict[int, dict[str, torch.Tensor]] = {}

    async def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.applied[version] = {name: t.clone() for name, t in weights.items()}


def held(store: SnapshotStore, version: int) -> Snapshot:
    """Publish `version` and hold it as a push would (its buffers are not recycled)."""
    store.put(version, state(version))
    snap = store.take_latest()
    assert snap is not None
    return snap


async def push(conn: MemoryConnection, snap: Snapshot, *, delta: bool) -> VersionAck:
    conn.send(WEIGHTS.encode(snap.push_header(delta=delta)))
    for index in range(len(snap.plans)):
        manifest, parts = await snap.bucket(index, delta=delta)
        conn.send(WEIGHTS.encode(manifest))
        await conn.send_bulk(b"".join(parts))
    ack = WEIGHTS.decode(await conn.recv())
    assert isinstance(ack, VersionAck)
    return ack


async def serve(receiver: WeightReceiver) -> tuple[MemoryConnection, list[asyncio.Task[None]]]:
    """The trainer's end of an in-memory connection to `receiver`, and the task serving it."""
    net = MemoryNetwork()
    served: list[asyncio.Task[None]] = []
    net.listen("gen", lambda c: served.append(asyncio.create_task(receiver.on_bulk(c, Identity("t", "trainer")))))
    conn = await net.connect("gen")
    assert WEIGHTS.decode(await conn.recv()) == Holding(0, base=-1)
    return conn, served


async def start_delta(conn: MemoryConnection, snap: Snapshot, push: Push) -> None:
    """Announce `push` and send the first bucket of `snap` as a delta."""
    conn.send(WEIGHTS.encode(push))
    manifest, parts = await snap.bucket(0, delta=True)
    conn.send(WEIGHTS.encode(manifest))
    await conn.send_bulk(b"".join(parts))


async def test_a_receiver_keeping_its_base_applies_deltas_and_refuses_one_against_another_base() -> None:
    engine = Engine()
    receiver = WeightReceiver(engine.load_weights, keep_base=True)
    conn, served = await serve(receiver)
    store = SnapshotStore(64 * 1024, delta=True)
    snaps = [held(store, v) for v in (1, 2, 3)]
    assert await push(conn, snaps[0], delta=False) == VersionAck(1, 1, base=1)
    assert await push(conn, snaps[1], delta=True) == VersionAck(2, 2, base=2)
    for name, tensor in state(2).items():
        assert torch.equal(engine.applied[2][name], tensor)
    stats = receiver.stats()
    assert stats.deltas == 1 and stats.bytes_received < stats.bytes_decoded
    # Version 3, a delta against version 2, announced as one against version 1: not what it keeps.
    await start_delta(conn, snaps[2], msgspec.structs.replace(snaps[2].push_header(delta=True), base=1))
    with pytest.raises(DeltaBaseMissing, match="against version 1; this receiver keeps 2"):
        await served[0]
    assert sorted(engine.applied) == [1, 2] and receiver.base == 2
    store.close()


async def test_a_receiver_not_keeping_a_base_says_so_and_refuses_a_delta() -> None:
    receiver = WeightReceiver(Engine().load_weights)
    conn, served = await serve(receiver)
    store = SnapshotStore(64 * 1024, delta=True)
    first, second = (held(store, v) for v in (1, 2))
    assert await push(conn, first, delta=False) == VersionAck(1, 1, base=-1)
    await start_delta(conn, second, second.push_header(delta=True))
    with pytest.raises(DeltaBaseMissing, match="keeps no version"):
        await served[0]
    store.close()
