"""CUDA IPC: a buffer on one process's GPU, opened by another process of the same host and copied device to device.

    shared = share(bucket)                     # the owner: a 1-D uint8 CUDA tensor it keeps, unchanged, until read
    ... send `shared` (a msgspec struct: what torch's CUDA IPC needs, no pickle) over an authenticated connection ...
    view = open_shared(shared)                 # another process of the same host: a tensor on the owner's memory
    staged.copy_(view)                         # device to device (NVLink or PCIe), then let go of `view`

This is the primitive the `cuda_ipc` transport (one host: the trainer's GPUs and the generators' GPUs, as in
`configs/gpu-node.yaml`) is to be built on; it is not a transport yet (docs/weights.md). `bin/gpu-check` measures it
between two processes on the lent GPU, and `tests/integration/test_cuda_paths.py -k cuda_ipc` checks it there.

It uses torch's own CUDA IPC (`torch.multiprocessing.reductions`, what `torch.multiprocessing` uses to pass a CUDA
tensor to a child), with the tensor's and storage's classes fixed here rather than taken from the wire: a peer sends
handles and sizes, never code. What torch requires holds here too: both processes see the owner's GPU (the handle
names a device by its index in the owner's `CUDA_VISIBLE_DEVICES`, so a reader must see the same devices in the
same order), and the owner keeps the buffer alive and unchanged until every reader let go of its view.
"""

from __future__ import annotations

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


class SharedCuda(msgspec.Struct, frozen=True, kw_only=True):
    """A CUDA buffer another process of the host may open (`open_shared`): torch's IPC handle and its place."""

    device: int
    """The owner's device index (as its `CUDA_VISIBLE_DEVICES` numbers them)."""
    handle: bytes
    storage_nbytes: int
    storage_offset: int
    """Bytes into the CUDA allocation the storage starts at."""
    offset: int
    """Bytes into the storage the buffer starts at."""
    nbytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def share(buffer: torch.Tensor) -> SharedCuda:
    """What another process needs to open `buffer` (a 1-D contiguous uint8 CUDA tensor)."""
    if not buffer.is_cuda or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"share: a 1-D contiguous uint8 CUDA tensor, not {buffer.dtype} {tuple(buffer.shape)}")
    _, args = reduce_tensor(buffer)  # type: ignore[no-untyped-call]
    (_, _, _, offset, _, _, device, handle, storage_nbytes, storage_offset, _, rc_handle, rc_offset, event, sync) = args
    return SharedCuda(
        device=device,
        handle=handle,
        storage_nbytes=storage_nbytes,
        storage_offset=storage_offset,
        offset=offset,
        nbytes=buffer.numel(),
        ref_counter_handle=rc_handle,
        ref_counter_offset=rc_offset,
        event_handle=event,
        event_sync_required=sync,
    )


def open_shared(shared: SharedCuda) -> torch.Tensor:
    """A uint8 tensor on the owner's memory (read it, copy from it; keep it no longer than needed)."""
    tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor,
        (shared.nbytes,),
        (1,),
        shared.offset,
        torch.storage.TypedStorage,
        torch.uint8,
        shared.device,
        shared.handle,
        shared.storage_nbytes,
        shared.storage_offset,
        False,
        shared.ref_counter_handle,
        shared.ref_counter_offset,
        shared.event_handle,
        shared.event_sync_required,
    )
    return tensor
