"""Published versions in bucket buffers, packed in the background, recycled once no push reads them.

`SnapshotStore.put` plans the buckets and returns: a packer thread copies (and casts, to the wire
dtype) the tensors into bucket buffers and computes each bucket's CRC-32C, one bucket after the
other, and a push sends bucket i as soon as it is packed, while the packer works on i + 1. What the
trainer must not do until `Snapshot.packed` is set is change the tensors it handed over (its next
optimizer step); its forward and backward passes may run meanwhile. Tensors it will not touch
again (`owned=True`: an export made for this version, a bf16 cast) need no such wait.

With deltas on (`SnapshotStore(delta=True)`), the packer also encodes each bucket against the same
bucket of the version before it in that dtype (`rollart.weights.delta`), for the receivers that
keep that version's bytes; that version's buffers are kept until it has.

Buffers of a version that is no longer the latest and that no push or packer uses are kept for the
next `put` (a copy into warm pages runs ~5x faster than into fresh ones: 7.8 vs 1.4 GiB/s measured
here for 64 MiB). `put` may run in a worker thread while the event loop's push tasks take and drop
snapshots, hence the lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from rollart.weights import delta as deltas
from rollart.weights.buckets import (
    BucketPlan,
    byte_view,
    checksum,
    dtype_name,
    new_buffer,
    pack_bucket,
    plan_buckets,
    split_tied,
)
from rollart.weights.wire import BucketManifest, Push

_SPARE_SETS = 2  # bucket-buffer sets kept for reuse


class Snapshot:
    """One published version in one wire dtype; `users` pushes (and the packer, until done) read it."""

    def __init__(
        self,
        version: int,
        *,
        seq: int,
        dtype: torch.dtype | None,
        plans: list[BucketPlan],
        buffers: list[torch.Tensor],
        tied: dict[str, str],
        base: Snapshot | None = None,
    ) -> None:
        self.version = version
        self.seq = seq
        """1 for the first version published, 2 for the next, ...: counts the versions a target skipped."""
        self.dtype = dtype
        self.plans = plans
        self.buffers = buffers
        """Per bucket: the buffer it is packed into, or an empty one when it is sent from `parts`."""
        self.parts: list[list[memoryview] | None] = [None] * len(plans)
        """Per bucket sent without a copy: its tensors' own bytes, with the padding between them."""
        self.tied = tied
        self.nbytes = sum(plan.nbytes for plan in plans)
        self.users = 1  # the packer
        self.crcs: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in plans]
        self.packed = threading.Event()
        """Set once every bucket is packed: the tensors handed to `put` are no longer read."""
        self.pack_s = 0.0
        self.base = base
        """The version deltas are made against, until the packer is done with it."""
        self.base_version = base.version if base is not None else -1
        """Its version; -1: no deltas (the first version, or deltas off)."""
        self.deltas: list[concurrent.futures.Future[bytes | None]] = [concurrent.futures.Future() for _ in plans]
        """Per bucket (with a base): its delta against the base, or None where it travels whole."""

    def push_header(self, relay: tuple[object, ...] = (), *, delta: bool = False) -> Push:
        return Push(
            self.version,
            len(self.plans),
            self.nbytes,
            dtype_name(self.dtype) if self.dtype is not None else "",
            tuple(self.tied.items()),
            relay,  # type: ignore[arg-type]
            base=self.base_version if delta else -1,
        )

    async def bucket(self, index: int, *, delta: bool = False) -> tuple[BucketManifest, list[memoryview]]:
        """Bucket `index`'s manifest and its bytes as the parts to send back to back, once the packer
        has packed (or checksummed, or encoded) it. `delta`: as a delta against `base_version`
        where that is smaller (the receivers keep that version's bytes)."""
        crc = await asyncio.wrap_future(self.crcs[index])
        manifest = self.plans[index].manifest(version=self.version, index=index, count=len(self.plans), crc32c=crc)
        if delta and (encoded := await asyncio.wrap_future(self.deltas[index])) is not None:
            stride = deltas.stride_of(manifest.tensors)
            manifest = msgspec.structs.replace(manifest, delta_nbytes=len(encoded), delta_stride=stride)
            return manifest, [memoryview(encoded)]
        parts = self.parts[index]
        return manifest, parts if parts is not None else [byte_view(self.buffers[index])]


class SnapshotStore:
    """The latest published version per wire dtype, and spare buffers to pack the next one into."""

    def __init__(self, bucket_bytes: int, *, delta: bool = False) -> None:
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.seq = 0
        self._lock = threading.Lock()
        self._latest: dict[torch.dtype | None, Snapshot] = {}
        self._spare: list[list[torch.Tensor]] = []
        self._packer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-pack")

    def put(
        self,
        version: int,
        state_dict: Mapping[str, torch.Tensor],
        dtypes: tuple[torch.dtype | None, ...] = (None,),
        *,
        owned: bool = False,
        contiguous: bool = True,
    ) -> list[Snapshot]:
        """Make `version` the latest in each wire dtype (None: as given); packing goes on in the background.

        `owned`: the caller will not change these tensors again (an export made for this push), so a
        bucket of contiguous CPU tensors already in the wire dtype is sent from their own memory, no
        copy, unless `contiguous` (a transport that needs one buffer per bucket: UCX)."""
        if not state_dict:
            raise ValueError("a weights version needs at least one tensor")
        newest = max((snap.version for snap in self._latest.values()), default=None)
        if newest is not None and version <= newest:
            raise ValueError(f"version {version} is not newer than the last one published ({newest})")
        unique, tied = split_tied(state_dict)
        pinned = any(t.is_cuda for t in unique.values())
        made = []
        for dtype in dict.fromkeys(dtypes):
            plans = plan_buckets(unique, self.bucket_bytes, dtype=dtype)
            as_is = owned and not contiguous and not self.delta  # deltas need the previous version's bytes
            direct = [as_is and _sendable_as_is(plan, unique) for plan in plans]
            buffers = self._buffers(
                [0 if as_is else plan.nbytes for plan, as_is in zip(plans, direct, strict=True)], pinned
            )
            with self._lock:
                self.seq += 1
                base = self._latest.get(dtype) if self.delta else None
                if base is not None:
                    base.users += 1  # until the packer has made the deltas
                snap = Snapshot(version, seq=self.seq, dtype=dtype, plans=plans, buffers=buffers, tied=tied, base=base)
                old, self._latest[dtype] = self._latest.get(dtype), snap
                if old is not None:
                    self._recycle_locked(old)
            made.append(snap)
        for snap in made:
            self._packer.submit(self._pack, snap, unique, pinned)
        return made

    def _pack(self, snap: Snapshot, tensors: Mapping[str, torch.Tensor], pinned: bool) -> None:
        started = time.perf_counter()
        try:
            for index, (plan, buffer, crc) in enumerate(zip(snap.plans, snap.buffers, snap.crcs, strict=True)):
                try:
                    if not buffer.numel() and plan.nbytes:
                        parts = snap.parts[index] = _parts(plan, tensors)
                        value = 0
                        for part in parts:
                            value = checksum(part, value)
                        crc.set_result(value)
                        continue
                    pack_bucket(plan, tensors, buffer)
                    if pinned:
                        torch.cuda.synchronize()  # the copies were issued without blocking
                    crc.set_result(checksum(byte_view(buffer)))
                    if snap.base is not None:
                        snap.deltas[index].set_result(_delta(snap.base, index, plan, buffer))
                except BaseException as exc:  # a push waiting for this bucket gets the error
                    futures: list[concurrent.futures.Future[Any]] = [*snap.crcs, *snap.deltas]
                    for rest in futures:
                        if not rest.done():
                            rest.set_exception(exc)
                    raise
        finally:
            snap.pack_s = time.perf_counter() - started
            snap.packed.set()
            for rest in snap.deltas:
                if not rest.done():
                    rest.set_result(None)  # no base: every bucket travels whole
            if snap.base is not None:
                base, snap.base = snap.base, None
                self.drop(base)
            self.drop(snap)

    def latest(self, dtype: torch.dtype | None) -> Snapshot | None:
        return self._latest.get(dtype)

    def latest_all(self) -> list[Snapshot]:
        with self._lock:
            return list(self._latest.values())

    def take_latest(self, dtype: torch.dtype | None = None) -> Snapshot | None:
        """The latest snapshot in `dtype`, counted as in use until `drop`ped."""
        with self._lock:
            snap = self._latest.get(dtype)
            if snap is not None:
                snap.users += 1
            return snap

    def drop(self, snap: Snapshot) -> None:
        with self._lock:
            snap.users -= 1
            self._recycle_locked(snap)

    def close(self) -> None:
        """Stop the packer and let every buffer go (the publisher is closed: nothing pushes them)."""
        self._packer.shutdown(wait=True)
        with self._lock:
            self._spare = []
            self._latest = {}

    def _buffers(self, sizes: list[int], pinned: bool) -> list[torch.Tensor]:
        with self._lock:
            for i, spare in enumerate(self._spare):
                if [b.numel() for b in spare] == sizes and all(b.is_pinned() == pinned for b in spare):
                    return self._spare.pop(i)
        return [new_buffer(n, pin_memory=pinned) for n in sizes]

    def _recycle_locked(self, snap: Snapshot) -> None:
        if snap.users == 0 and self._latest.get(snap.dtype) is not snap and snap.buffers:
            self._spare = [*self._spare, snap.buffers][-_SPARE_SETS:]
            snap.buffers, snap.parts = [], []  # and the tensors a bucket sent without a copy
            snap.deltas = []


def _delta(base: Snapshot, index: int, plan: BucketPlan, buffer: torch.Tensor) -> bytes | None:
    """Bucket `index`'s delta against the same bucket of `base`; None where it travels whole."""
    if index >= len(base.plans) or base.plans[index] != plan or not base.buffers or not base.buffers[index].numel():
        return None
    crc = base.crcs[index]
    if not crc.done() or crc.exception() is not None:
        return None  # the base never packed this bucket
    return deltas.encode(byte_view(buffer), byte_view(base.buffers[index]), deltas.stride_of(plan.entries))


def _sendable_as_is(plan: BucketPlan, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor of the bucket can be sent from its own memory: CPU, contiguous, as it travels."""
    for entry in plan.entries:
        tensor = tensors[entry.name]
        if tensor.is_cuda or not tensor.is_contiguous() or dtype_name(tensor.dtype) != entry.dtype:
            return False
    return True


def _parts(plan: BucketPlan, tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:
    """The bucket's payload as its tensors' bytes and the zero padding between them."""
    parts: list[memoryview] = []
    end = 0
    for entry in plan.entries:
        if entry.offset > end:
            parts.append(memoryview(bytes(entry.offset - end)))
        if entry.nbytes:
            parts.append(tensors[entry.name].detach().reshape(-1).view(torch.uint8).numpy().data.cast("B"))
        end = entry.offset + entry.nbytes
    return parts
