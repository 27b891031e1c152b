"""Weights out of the ranks without a pipe: rank 0 writes each gathered tensor into the trainer node's shared
memory, and answers only where each one lies.

    # the trainer node (`RankGroupEngine.begin_export`)
    target = ExportTarget(path=segment.path, offset=0, nbytes=export_nbytes(shapes, dtype))
    placed = ranks.submit("export", target, dtype)          # [(name, dtype, shape, offset), ...]

    # rank 0 (`fsdp.rank`, `megatron.rank`), once per tensor, gathered bucket by bucket on its device
    sink = SharedExport(target, device)
    sink.write(name, whole.to(dtype))                       # cast on the device, copied without blocking
    placed = sink.finish()                                  # waits for the copies

The node's buffers are `rollart.shm` segments (a `BufferPool(shared=True)`, so a buffer a published version still
reads is never written again until it is let go), and the publisher sends from them as they are. So an export is
one copy, device to shared host memory, and nothing is pickled: before, rank 0 copied every tensor to host memory,
pickled it through its pipe, and the node built the state dict from the pieces. On CUDA the mapping is registered
with the driver as pinned memory, once per segment (`cudaHostRegister`), so the copies run asynchronously at the
link's speed while the next tensor is gathered.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from rollart.shm import attach

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes."""
_MAPPED = 4
"""Segments rank 0 keeps mapped (and pinned) between exports: the node's pool reuses a few."""


@dataclasses.dataclass(frozen=True)
class ExportTarget:
    """Where rank 0 writes a version: `nbytes` at `offset` of the shared-memory segment at `path`."""

    path: str
    offset: int
    nbytes: int


Placed = tuple[str, str, tuple[int, ...], int]
"""(name, dtype name without `torch.`, shape, byte offset from the target's start)."""


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def export_nbytes(tensors: Iterable[tuple[tuple[int, ...], torch.dtype]], dtype: torch.dtype | None) -> int:
    """Bytes a target needs for tensors of these (global shape, dtype) exported in `dtype` (None: their own), in
    whatever order they are written."""
    return sum(aligned((dtype or own).itemsize * _numel(shape)) for shape, own in tensors)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


_mapped: OrderedDict[tuple[str, int, int], tuple[Any, torch.Tensor, bool]] = OrderedDict()
"""(path, inode, size) -> (mapping, a uint8 tensor over it, pinned): this rank's mappings, newest last."""


def _mapping(path: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the first `nbytes` of the segment at `path`, mapped for writing (and pinned on CUDA)."""
    try:
        inode = os.stat(path).st_ino
    except OSError as error:
        raise ConnectionError(f"cannot open the export buffer at {path}: {error.strerror}") from None
    key = (path, inode, nbytes)
    if key in _mapped:
        _mapped.move_to_end(key)
        return _mapped[key][1]
    mapping = attach(path, nbytes, writable=True)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    pinned = device.type == "cuda" and nbytes > 0
    if pinned:
        code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of the export buffer failed with {code}")
    _mapped[key] = (mapping, buffer, pinned)
    while len(_mapped) > _MAPPED:
        _, (_, old, was_pinned) = _mapped.popitem(last=False)
        if was_pinned:
            torch.cuda.cudart().cudaHostUnregister(old.data_ptr())  # type: ignore[no-untyped-call]
    return buffer


class SharedExport:
    """Rank 0's end of one export: each tensor written into the target, its place kept for the answer."""

    def __init__(self, target: ExportTarget, device: torch.device) -> None:
        self.target = target
        buffer = _mapping(target.path, target.offset + target.nbytes, device)
        self._region = buffer[target.offset : target.offset + target.nbytes]
        self._end = 0
        self._placed: list[Placed] = []
        self._cuda = device.type == "cuda"

    def place(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free place of the target for a tensor of this shape and dtype, as a CPU tensor to copy into
        (pinned on CUDA, so a copy from the device need not block)."""
        start = aligned(self._end)
        end = start + dtype.itemsize * _numel(shape)
        if end > self.target.nbytes:
            raise ValueError(f"export: {name} does not fit the {self.target.nbytes} bytes the node gave")
        self._placed.append((name, str(dtype).removeprefix("torch."), tuple(shape), start))
        self._end = end
        return self._region[start:end].view(dtype).view(shape)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` (on any device, in the dtype it travels in) to the next free place of the target."""
        self.place(name, tuple(tensor.shape), tensor.dtype).copy_(tensor.detach(), non_blocking=tensor.is_cuda)

    def finish(self) -> list[Placed]:
        """Every tensor's place, once every copy has landed."""
        if self._cuda:
            torch.cuda.synchronize()
        return self._placed


def placed_tensors(region: torch.Tensor, placed: list[Placed]) -> dict[str, torch.Tensor]:
    """The node's end: the exported tensors by name, views of `region` (the target's bytes) where rank 0 put
    them."""
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape, offset in placed:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"export: {name} came as {dtype_name!r}, which is not a torch dtype")
        end = offset + dtype.itemsize * _numel(shape)
        if not 0 <= offset <= end <= region.numel():
            raise ValueError(f"export: {name} lies outside the {region.numel()} bytes given")
        tensors[name] = region[offset:end].view(dtype).view(shape)
    return tensors
