"""Weight buckets (plan, pack, unpack, checks), snapshots, and the receiver's rules over an in-memory
connection; then what a publisher sends fuzzed: the weights channel, manifests that do not fit their
payload, buckets of any version, index and count, and a receiver fed any of it."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping

import msgspec
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from rollart.protocol import Identity, MemoryConnection, MemoryNetwork
from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import ConnectionClosed, ProtocolError
from rollart.weights.buckets import (
    ALIGN,
    DTYPES,
    VersionAssembly,
    byte_view,
    checksum,
    new_buffer,
    pack_bucket,
    plan_buckets,
    split_tied,
    unpack_bucket,
)
from rollart.weights.config import WeightsSpec
from rollart.weights.pool import BufferPool
from rollart.weights.publisher import WeightPublisher, _cancel_all
from rollart.weights.receiver import WeightReceiver
from rollart.weights.snapshot import SnapshotStore
from rollart.weights.wire import (
    WEIGHTS,
    BucketManifest,
    ChecksumMismatch,
    Holding,
    ManifestForged,
    MissingBucket,
    Push,
    TensorEntry,
    VersionAck,
    WeightFormatError,
    manifest_mac,
)
from tests.strategies import (
    FUZZ_EXAMPLES,
    MSGPACK_INTS,
    check_decode,
    messages_of,
    msgpack_trees,
    mutations,
    tagged_trees,
)

Buckets = list[tuple[BucketManifest, bytearray]]


def packed(tensors: Mapping[str, torch.Tensor], bucket_bytes: int, version: int = 1) -> Buckets:
    """Every bucket of `tensors` as (manifest, payload), the way a publisher sends them."""
    plans = plan_buckets(tensors, bucket_bytes)
    out = []
    for index, plan in enumerate(plans):
        buffer = new_buffer(plan.nbytes)
        pack_bucket(plan, tensors, buffer)
        payload = bytearray(byte_view(buffer))
        out.append((plan.manifest(version=version, index=index, count=len(plans), crc32c=checksum(payload)), payload))
    return out


def push_of(buckets: Buckets) -> Push:
    first = buckets[0][0]
    return Push(first.version, first.count, sum(manifest.nbytes for manifest, _ in buckets))


def mixed_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(33, 16, generator=gen),
        "layer.0.bf16": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "layer.0.fp16": torch.randn(3, generator=gen).to(torch.float16),
        "layer.0.fp64": torch.randn(2, 2, generator=gen, dtype=torch.float64),
        "steps": torch.tensor(12345678901, dtype=torch.int64),  # 0-dim
        "ids": torch.arange(-5, 6, dtype=torch.int8),
        "bytes": torch.arange(0, 250, 7, dtype=torch.uint8),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(4, 6, generator=gen).t(),  # not contiguous
        "rotary": torch.randn(3, 2, generator=gen, dtype=torch.complex64),
        "param": torch.nn.Parameter(torch.randn(5, generator=gen)),  # requires grad
    }


# -- planning --------------------------------------------------------------------------------------


def test_small_tensors_share_buckets_in_order_and_stay_under_the_size() -> None:
    tensors = {f"t{i}": torch.zeros(1000) for i in range(10)}  # 4000 bytes each
    plans = plan_buckets(tensors, bucket_bytes=10_000)
    assert [len(p.entries) for p in plans] == [2, 2, 2, 2, 2]
    assert [e.name for p in plans for e in p.entries] == list(tensors)
    assert all(p.nbytes <= 10_000 for p in plans)
    assert all(e.offset % ALIGN == 0 for p in plans for e in p.entries)


def test_a_tensor_bigger_than_a_bucket_gets_its_own() -> None:
    tensors = {"a": torch.zeros(10), "big": torch.zeros(5000), "b": torch.zeros(10), "c": torch.zeros(10)}
    plans = plan_buckets(tensors, bucket_bytes=1024)
    assert [[e.name for e in p.entries] for p in plans] == [["a"], ["big"], ["b", "c"]]
    assert plans[1].nbytes == 20_000


def test_the_default_bucket_size_is_64_mib() -> None:
    tensors = {f"t{i}": torch.empty(4 * 1024 * 1024, dtype=torch.uint8) for i in range(40)}  # 160 MiB
    plans = plan_buckets(tensors)
    assert [len(p.entries) for p in plans] == [16, 16, 8]
    assert plans[0].nbytes == 64 * 1024 * 1024


# -- round trip and checks -------------------------------------------------------------------------


def test_every_dtype_round_trips_without_a_copy_on_the_receiving_side() -> None:
    tensors = mixed_state_dict()
    buckets = packed(tensors, bucket_bytes=512)
    assert len(buckets) == 3
    received: dict[str, torch.Tensor] = {}
    for manifest, payload in buckets:
        out = unpack_bucket(manifest, payload)
        start = torch.frombuffer(payload, dtype=torch.uint8).data_ptr() if payload else 0
        for tensor in out.values():
            if tensor.numel():
                assert start <= tensor.data_ptr() < start + len(payload)  # a view into the payload
        received.update(out)
    assert list(received) == list(tensors)
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype, name
        assert received[name].shape == tensor.shape, name
        assert torch.equal(received[name], tensor.detach()), name


def test_a_flipped_byte_is_caught_by_the_checksum() -> None:
    manifest, payload = packed({"w": torch.randn(100)}, bucket_bytes=1 << 20)[0]
    payload[123] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="version 1 bucket 0/1: payload CRC-32"):
        unpack_bucket(manifest, payload)


def test_a_truncated_payload_is_refused() -> None:
    manifest, payload = packed({"w": torch.randn(100)}, bucket_bytes=1 << 20)[0]
    with pytest.raises(WeightFormatError, match="payload has 399 bytes; its manifest says 400"):
        unpack_bucket(manifest, payload[:-1])


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (TensorEntry("w", "float32", (10,), 64, 40), "does not fit"),  # runs past the end
        (TensorEntry("w", "float32", (10,), 2, 40), "does not fit"),  # misaligned for float32
        (TensorEntry("w", "float32", (11,), 0, 40), "cannot have 40 bytes"),
        (TensorEntry("w", "float32", (-10,), 0, 40), "cannot have 40 bytes"),
        (TensorEntry("w", "__class__", (10,), 0, 40), "unknown dtype '__class__'"),
        # Found by fuzzing: 0 elements, so the size matched, then torch's `view` raised TypeError
        # (a dimension past int64) or RuntimeError (dimensions whose product is).
        (TensorEntry("w", "float32", (0, 2**64 - 1), 0, 0), "cannot have 0 bytes"),
        (TensorEntry("w", "float32", (3, 2**63 - 1, 0), 0, 0), "cannot have 0 bytes"),
    ],
)
def test_a_manifest_that_does_not_fit_its_payload_is_refused(entry: TensorEntry, problem: str) -> None:
    payload = bytearray(100)
    manifest = BucketManifest(1, 0, 1, len(payload), checksum(payload), (entry,))
    with pytest.raises(WeightFormatError, match=problem):
        unpack_bucket(manifest, payload)


def test_a_read_only_payload_is_refused() -> None:
    manifest, payload = packed({"w": torch.randn(4)}, bucket_bytes=1 << 20)[0]
    with pytest.raises(ValueError, match="writable"):
        unpack_bucket(manifest, bytes(payload))  # type: ignore[arg-type]


def test_a_version_without_one_of_its_buckets_is_refused() -> None:
    buckets = packed({f"t{i}": torch.zeros(100) for i in range(3)}, bucket_bytes=400)
    assembly = VersionAssembly(1, 3)
    for manifest, payload in (buckets[0], buckets[2]):
        assembly.add(manifest, unpack_bucket(manifest, payload))
    with pytest.raises(MissingBucket, match=r"version 1: buckets \[1\] of 3 never arrived"):
        assembly.finish()


def test_a_version_announcing_more_buckets_than_can_be_listed_is_refused_at_once() -> None:
    # Found by fuzzing: `finish` listed every missing index, 2**64 - 2 of them here (the receiver
    # calls it when the bucket numbered count - 1 arrives), and never returned.
    count = 2**64 - 1
    assembly = VersionAssembly(1, count)
    assembly.add(BucketManifest(1, count - 1, count, 0, checksum(b""), ()), {})
    with pytest.raises(MissingBucket, match=rf"buckets \[0, 1, .*, 9\] and {count - 11} more of {count} never"):
        assembly.finish()


# -- snapshots -------------------------------------------------------------------------------------


async def test_a_snapshot_is_a_copy_and_its_buffers_are_reused_once_unused() -> None:
    store = SnapshotStore(bucket_bytes=1 << 20)
    weights = {"w": torch.ones(1000), "b": torch.zeros(10, dtype=torch.bfloat16)}
    [first] = store.put(1, weights)
    first.packed.wait()
    weights["w"].add_(1)  # the optimizer's next step
    manifest, _ = await first.bucket(0)
    assert torch.equal(unpack_bucket(manifest, byte_view(first.buffers[0]))["w"], torch.ones(1000))
    first_ptr = first.buffers[0].data_ptr()
    store.put(2, weights)[0].packed.wait()  # version 1 is no longer the latest and nobody pushes it: spare
    [third] = store.put(3, weights)
    assert third.buffers[0].data_ptr() == first_ptr
    with pytest.raises(ValueError, match="version 3 is not newer than the last one published"):
        store.put(3, weights)


async def test_a_snapshot_being_pushed_keeps_its_buffers() -> None:
    store = SnapshotStore(bucket_bytes=1 << 20)
    weights = {"w": torch.ones(1000)}
    store.put(1, weights)[0].packed.wait()
    pushing = store.take_latest()
    assert pushing is not None
    store.put(2, weights)[0].packed.wait()
    store.put(3, weights)[0].packed.wait()
    latest = store.take_latest()
    assert latest is not None and pushing.buffers
    assert latest.buffers[0].data_ptr() != pushing.buffers[0].data_ptr()  # version 3 did not take them
    store.drop(pushing)
    assert not pushing.buffers  # recycled once the push let go


def test_a_receive_buffer_is_reused_only_once_no_tensor_holds_it() -> None:
    pool = BufferPool()
    manifest, payload = packed({"w": torch.arange(100.0)}, bucket_bytes=1 << 20)[0]
    view = pool.take(len(payload))
    view[:] = payload
    kept = unpack_bucket(manifest, view)["w"]  # an engine that keeps the tensors it was given
    del view
    other = pool.take(len(payload))
    assert (pool.allocated, pool.reused) == (2, 0)  # `kept` still views the first buffer
    other[:] = bytes(len(payload))
    assert torch.equal(kept, torch.arange(100.0))
    del kept, other
    pool.take(len(payload))
    assert (pool.allocated, pool.reused) == (2, 1)


def test_idle_receive_buffers_beyond_the_cap_are_let_go() -> None:
    pool = BufferPool()
    for size in (1000, 2000, 3000):
        pool.take(size)  # each dropped at once: idle
    assert pool.nbytes == 6000
    pool.cap_bytes = 4000
    pool.take(500)
    assert pool.nbytes == 3500  # the least recently used idle ones went first


def test_idle_receive_buffers_behind_one_in_use_are_let_go() -> None:
    pool = BufferPool()
    held = pool.take(1000)  # first in the pool, and in use
    for size in (2000, 3000):
        pool.take(size)
    pool.cap_bytes = 2000
    pool.take(500)
    assert pool.nbytes == 1500 and len(held) == 1000


# -- the receiver's rules ----------------------------------------------------------------------------


class Engine:
    """Records what it was given; refuses a version when told to."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.refuse: set[int] = set()

    async def load_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        if version in self.refuse:
            raise RuntimeError(f"no room for version {version}")
        self.applied.append((version, weights))


Pushed = tuple[MemoryConnection, WeightReceiver, Engine, list[asyncio.Task[None]]]


async def serve_receiver() -> Pushed:
    """A receiver serving one in-memory bulk connection: the publisher's end, the receiver, its
    engine, and the task serving the connection (once it runs)."""
    engine = Engine()
    receiver = WeightReceiver(engine.load_weights, version=0)
    net = MemoryNetwork()
    served: list[asyncio.Task[None]] = []
    net.listen("gen-0", lambda conn: served.append(asyncio.create_task(receiver.on_bulk(conn, Identity("t", "t")))))
    return await net.connect("gen-0"), receiver, engine, served


@pytest.fixture
async def pushed() -> AsyncIterator[Pushed]:
    """A receiver serving one in-memory bulk connection; yields the publisher's end."""
    conn, receiver, engine, served = await serve_receiver()
    assert WEIGHTS.decode(await conn.recv()) == Holding(0)
    yield conn, receiver, engine, served
    conn.close()
    for task in served:
        task.cancel()
    await asyncio.gather(*served, return_exceptions=True)


async def send(conn: MemoryConnection, buckets: Buckets) -> None:
    conn.send(WEIGHTS.encode(push_of(buckets)))
    for manifest, payload in buckets:
        conn.send(WEIGHTS.encode(manifest))
        await conn.send_bulk(payload)


def version_of(value: float, version: int) -> Buckets:
    return packed({f"t{i}": torch.full((100,), value) for i in range(4)}, bucket_bytes=800, version=version)


async def test_receiver_applies_newer_ignores_older_and_replaces_a_half_received_version(pushed: Pushed) -> None:
    conn, receiver, engine, _ = pushed
    await send(conn, version_of(2.0, 2))
    assert WEIGHTS.decode(await conn.recv()) == VersionAck(2, 2)
    await send(conn, version_of(1.0, 1))  # older: acknowledged, not applied
    assert WEIGHTS.decode(await conn.recv()) == VersionAck(1, 2)
    await send(conn, version_of(3.0, 3)[:1])  # half of version 3 ...
    await send(conn, version_of(4.0, 4))  # ... then version 4 replaces it
    assert WEIGHTS.decode(await conn.recv()) == VersionAck(4, 4)
    assert [v for v, _ in engine.applied] == [2, 4]
    assert all(torch.equal(t, torch.full((100,), 4.0)) for t in engine.applied[-1][1].values())
    assert len(engine.applied[-1][1]) == 4
    stats = receiver.stats()
    assert (stats.version, stats.applied, stats.ignored, stats.replaced) == (4, 2, 1, 1)


async def test_receiver_reports_a_version_the_engine_refused(pushed: Pushed) -> None:
    conn, receiver, engine, _ = pushed
    engine.refuse.add(1)
    await send(conn, version_of(1.0, 1))
    ack = WEIGHTS.decode(await conn.recv())
    assert isinstance(ack, VersionAck)
    assert (ack.version, ack.holding, ack.error) == (1, 0, "RuntimeError: no room for version 1")
    await send(conn, version_of(2.0, 2))  # the connection carries on
    assert WEIGHTS.decode(await conn.recv()) == VersionAck(2, 2)
    assert receiver.stats().apply_failures == 1


async def test_receiver_drops_the_connection_on_a_corrupt_bucket(pushed: Pushed) -> None:
    conn, receiver, engine, served = pushed
    buckets = version_of(1.0, 1)
    buckets[1][1][10] ^= 0xFF
    await send(conn, buckets)
    with pytest.raises(ChecksumMismatch):
        await served[0]
    assert engine.applied == []
    assert receiver.stats().checksum_failures == 1


async def test_a_manifest_without_the_mac_the_run_secret_gives_is_refused(pushed: Pushed) -> None:
    conn, receiver, engine, served = pushed
    receiver.relay_as(Identity("gen-0", "generator"), b"the run's secret", SessionConfig())  # it knows the secret

    def signed(buckets: Buckets, secret: bytes) -> Buckets:
        return [(msgspec.structs.replace(m, mac=manifest_mac(secret, m)), payload) for m, payload in buckets]

    await send(conn, signed(version_of(1.0, 1), b"the run's secret"))
    assert WEIGHTS.decode(await conn.recv()) == VersionAck(1, 1)
    forged = signed(version_of(2.0, 2), b"the run's secret")
    entry = msgspec.structs.replace(forged[0][0].tensors[0], name="lm_head.weight")  # a wrong name, the MAC kept
    tampered = msgspec.structs.replace(forged[0][0], tensors=(entry, *forged[0][0].tensors[1:]))
    await send(conn, [(tampered, forged[0][1]), *forged[1:]])
    with pytest.raises(ManifestForged, match="MAC is wrong"):
        await served[0]
    assert [version for version, _ in engine.applied] == [1]


# -- fuzzing: what a publisher sends -----------------------------------------------------------------


@settings(max_examples=2 * FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_fuzz_the_weights_channel_decodes_or_refuses_anything(data: st.DataObject) -> None:
    encoded = WEIGHTS.encode(data.draw(messages_of(WEIGHTS), label="message"))
    assert check_decode(WEIGHTS, encoded) is not None
    wire = data.draw(
        st.one_of(
            mutations(encoded),
            msgpack_trees.map(msgspec.msgpack.encode),
            tagged_trees(WEIGHTS).map(msgspec.msgpack.encode),
            st.binary(max_size=64),
        ),
        label="wire",
    )
    check_decode(WEIGHTS, wire)


HONEST_VERSION = version_of(1.0, 1)
"""Two buckets of an honest version 1: what the receiver fuzz alters."""

mostly = st.sampled_from([True, True, True, False])
dims = st.one_of(st.integers(0, 3), st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1]), MSGPACK_INTS)


@st.composite
def tensor_entries(draw: st.DrawFn) -> TensorEntry:
    """An entry that mostly agrees with itself (a known dtype, its size its shape's, aligned near
    the start), so that what follows those checks is reached, with anything msgpack can carry."""
    dtype = draw(st.sampled_from(sorted(DTYPES))) if draw(mostly) else draw(st.text(max_size=8))
    shape = tuple(draw(st.lists(dims, max_size=3)))
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else 1
    true_size = math.prod(shape) * itemsize
    nbytes = true_size if draw(mostly) else draw(st.one_of(st.integers(0, 96), MSGPACK_INTS))
    offset = draw(st.one_of(st.just(0), st.integers(0, 8).map(lambda k: k * itemsize), MSGPACK_INTS))
    return TensorEntry(draw(st.sampled_from("abc")), dtype, shape, offset, nbytes)


@settings(max_examples=3 * FUZZ_EXAMPLES, deadline=None)
@given(payload=st.binary(max_size=96), entries=st.lists(tensor_entries(), max_size=3), data=st.data())
def test_fuzz_a_manifest_fits_its_payload_or_is_refused(
    payload: bytes, entries: list[TensorEntry], data: st.DataObject
) -> None:
    buffer = bytearray(payload)
    # Mostly the payload's true size and checksum, so that the entries are what gets checked.
    nbytes = len(buffer) if data.draw(mostly, label="true size") else data.draw(MSGPACK_INTS)
    crc = checksum(buffer) if data.draw(mostly, label="true crc") else data.draw(MSGPACK_INTS)
    manifest = BucketManifest(1, 0, 1, nbytes, crc, tuple(entries))
    try:
        tensors = unpack_bucket(manifest, buffer)
    except WeightFormatError as exc:  # ChecksumMismatch is one
        event(f"refused: {type(exc).__name__}")
        return
    event("unpacked")
    start = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr() if buffer else 0
    assert list(tensors) == [entry.name for entry in entries]
    for entry in entries:
        tensor = tensors[entry.name]
        assert (tensor.dtype, tuple(tensor.shape)) == (DTYPES[entry.dtype], entry.shape)
        assert tensor.numel() * tensor.element_size() == entry.nbytes
        if entry.nbytes:  # a view inside the payload, nowhere else
            assert start + entry.offset == tensor.data_ptr()
            assert entry.offset + entry.nbytes <= len(buffer)


bucket_numbers = st.one_of(st.integers(0, 4), MSGPACK_INTS)
Arrival = tuple[int, int, int, str]
"""A bucket's (version, index, count) and the name of its one tensor."""


@st.composite
def arrivals(draw: st.DrawFn, count: int) -> list[Arrival]:
    """A version's buckets in any order, perhaps with some lost or altered, or anything at all."""
    names = st.sampled_from("xyzw")
    if draw(st.booleans()):
        return draw(st.lists(st.tuples(st.integers(0, 2), bucket_numbers, bucket_numbers, names), max_size=6))
    honest = [(1, index, count, "xyzw"[index]) for index in draw(st.permutations(range(min(count, 4))))]
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(honest)))
        honest[at:at] = [(draw(st.integers(0, 2)), draw(bucket_numbers), draw(bucket_numbers), draw(names))]
    return honest[: draw(st.integers(0, len(honest)))] if draw(st.booleans()) else honest


@settings(max_examples=2 * FUZZ_EXAMPLES, deadline=None)
@given(count=st.one_of(st.integers(1, 4), bucket_numbers), data=st.data())
def test_fuzz_a_version_assembles_from_its_buckets_or_is_refused(count: int, data: st.DataObject) -> None:
    arrived = data.draw(arrivals(count), label="arrivals")
    try:
        assembly = VersionAssembly(1, count)
        for version, index, said_count, name in arrived:
            assembly.add(BucketManifest(version, index, said_count, 4, 0, ()), {name: torch.zeros(1)})
        weights = assembly.finish()
    except WeightFormatError as exc:  # MissingBucket is one
        event(f"refused: {type(exc).__name__}")
        return
    event("assembled")
    assert sorted(index for _, index, _, _ in arrived) == list(range(count))  # every bucket, once each
    assert len(weights) == len({name for *_, name in arrived}) == count  # and no tensor twice


@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
async def test_fuzz_a_receiver_fed_anything_ends_the_connection_with_a_protocol_error(data: st.DataObject) -> None:
    honest = [(WEIGHTS.encode(manifest), bytes(payload)) for manifest, payload in HONEST_VERSION]
    start: list[tuple[bytes, bytes | None]] = [(WEIGHTS.encode(push_of(HONEST_VERSION)), None)]
    steps = start + list(honest) if data.draw(st.booleans(), label="whole version first") else list(start)
    for _ in range(data.draw(st.integers(1, 3), label="buckets altered")):
        frame, payload = data.draw(st.sampled_from(honest), label="bucket")
        any_manifest = messages_of(WEIGHTS).map(WEIGHTS.encode)
        frame = data.draw(st.one_of(st.just(frame), mutations(frame), any_manifest), label="manifest")
        payload = data.draw(st.one_of(st.just(payload), mutations(payload)), label="payload")
        steps.append((frame, payload))
    conn, receiver, engine, served = await serve_receiver()
    for frame, payload in steps:
        conn.send(frame)
        if payload is not None:
            await conn.send_bulk(payload)
    conn.close()  # what was sent is still delivered, then the connection ends
    with pytest.raises((ProtocolError, ConnectionClosed)) as info:
        await asyncio.wait_for(served[0], 5)
    event(type(info.value).__name__ + (", applied" if engine.applied else ""))
    assert receiver.version == max((version for version, _ in engine.applied), default=0)


async def test_closing_the_publisher_stops_a_push_task_that_swallowed_a_cancel() -> None:
    # What asyncio.wait_for on Python 3.11 can do when its inner future completes as the cancel lands.
    lost = 0

    async def stubborn() -> None:
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                lost += 1
                if lost > 1:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await _cancel_all([task])
    assert task.cancelled() and lost == 2


def test_tied_weights_travel_once_and_come_back_under_both_names() -> None:
    embed = torch.randn(16, 8)
    state = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(8), "lm_head.weight": embed}
    unique, tied = split_tied(state)
    assert list(unique) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert split_tied({"a": embed, "b": embed.clone()})[1] == {}  # equal values, own storage: both travel


def test_floating_point_tensors_travel_in_the_wire_dtype_and_others_as_they_are() -> None:
    state = {"w": torch.randn(5, 3), "ids": torch.arange(4), "half": torch.randn(2, dtype=torch.float16)}
    [plan] = plan_buckets(state, 1 << 20, dtype=torch.bfloat16)
    assert [(e.name, e.dtype, e.nbytes) for e in plan.entries] == [
        ("w", "bfloat16", 30),
        ("ids", "int64", 32),
        ("half", "bfloat16", 4),
    ]
    buffer = new_buffer(plan.nbytes)
    pack_bucket(plan, state, buffer)
    out = unpack_bucket(
        plan.manifest(version=1, index=0, count=1, crc32c=checksum(byte_view(buffer))), byte_view(buffer)
    )
    assert torch.equal(out["w"], state["w"].to(torch.bfloat16)) and torch.equal(out["ids"], state["ids"])
    assert torch.equal(out["half"], state["half"].to(torch.bfloat16))


def test_a_push_deadline_grows_with_its_bytes_and_hops_unless_set() -> None:
    publisher = WeightPublisher(Identity("t", "trainer"), b"s", SessionConfig(), WeightsSpec(bucket_mb=64))
    one_gib = publisher.deadline_s(1 << 30)
    assert one_gib > publisher.deadline_s(100 << 20) > 30.0
    assert publisher.deadline_s(1 << 30, hops=4) > one_gib  # three more buckets' worth down a chain
    assert one_gib == pytest.approx(30.0 + 4 * (1 << 30) / (100 * 1024**2))  # at the assumed 100 MiB/s
    fixed = WeightPublisher(Identity("t", "trainer"), b"s", SessionConfig(), WeightsSpec(push_timeout_s=7.0))
    assert fixed.deadline_s(1 << 40, hops=9) == 7.0


async def test_an_owned_export_is_sent_from_its_own_memory_with_the_packed_checksum() -> None:
    weights = {"a": torch.randn(10), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(3, 3)}
    [direct] = SnapshotStore(1 << 20).put(1, weights, owned=True, contiguous=False)
    [packed_copy] = SnapshotStore(1 << 20).put(1, weights)
    manifest, parts = await direct.bucket(0)
    assert manifest.tensors == (await packed_copy.bucket(0))[0].tensors  # the same layout
    assert direct.buffers[0].numel() == 0 and manifest.crc32c == checksum(b"".join(parts))
    received = unpack_bucket(manifest, bytearray(b"".join(parts)))
    assert all(torch.equal(received[name], tensor) for name, tensor in weights.items())
    assert any(torch.frombuffer(part, dtype=torch.uint8).data_ptr() == weights["a"].data_ptr() for part in parts)
    [cast] = SnapshotStore(1 << 20).put(1, weights, (torch.bfloat16,), owned=True, contiguous=False)
    assert cast.buffers[0].numel() > 0  # a cast is a copy: packed
