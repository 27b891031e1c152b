"""Whole weights from FSDP2's shards, a bucket at a time: one collective per bucket instead of one per tensor.

FSDP2 shards every parameter along its first dimension as `torch.chunk` splits it (`Shard(0)`: the first ranks get
`ceil(rows / world)` rows, the last ones what is left, possibly none). For an export, each rank casts its local
rows of a bucket's tensors to the wire dtype on its device, lays them end to end in one buffer (every rank's
layout follows from the global shapes alone, so no sizes are exchanged) and sends it to rank 0 in one message;
rank 0 casts its own rows straight into their places in the export buffer, then copies each other rank's after
them.
Per-tensor `full_tensor()` paid a collective's latency for every weight (about a hundred for the BPE test model)
and moved the training dtype's bytes before casting (benchmarks/results/weight_sync.md measures both).

On CUDA the copies to the (pinned) export buffer do not block; the next bucket waits for them before it reuses
the gather buffers.

A tensor that is not sharded that way (a plain tensor: every rank holds it whole; another placement) is taken as
it is, or through `full_tensor()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


@dataclass(frozen=True)
class _Part:
    name: str
    tensor: DTensor
    rows: list[int]
    """Rows each rank holds."""
    row_numel: int


def row_split(rows: int, world: int) -> list[int]:
    """How `torch.chunk` (and so FSDP2) splits `rows` over `world` ranks; ranks past the chunks get none."""
    sizes = [len(chunk) for chunk in torch.arange(rows).chunk(world)] if rows else []
    return sizes + [0] * (world - len(sizes))


Into = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]
"""Rank 0's destination for a whole tensor of this name, shape and dtype (a view of the export buffer)."""


def whole_tensors(
    named: Iterable[tuple[str, torch.Tensor]],
    into: Into | None,
    *,
    dtype: torch.dtype | None,
    bucket_bytes: int,
    rank: int,
    world: int,
) -> None:
    """Write every tensor of `named`, whole and in `dtype` (None: its own), into `into`'s destinations on rank 0
    (None on the other ranks), each rank's rows copied straight to their place; every rank must run it through
    (the gathers are collectives)."""
    bucket: list[_Part] = []
    size = 0
    for name, tensor in named:
        out = dtype or tensor.dtype
        sharded = isinstance(tensor, DTensor) and tuple(tensor.placements) == (Shard(0),) and tensor.dim() > 0
        if bucket and (not sharded or out != (dtype or bucket[0].tensor.dtype) or size >= bucket_bytes):
            _gather(bucket, into, dtype, rank, world)
            bucket, size = [], 0
        if not sharded:
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if into is not None:
                into(name, tuple(whole.shape), out).copy_(whole.detach(), non_blocking=whole.is_cuda)
            continue
        assert isinstance(tensor, DTensor)
        row_numel = 1
        for n in tensor.shape[1:]:
            row_numel *= n
        bucket.append(_Part(name, tensor, row_split(tensor.shape[0], world), row_numel))
        size += tensor.numel() * out.itemsize
    if bucket:
        _gather(bucket, into, dtype, rank, world)


_scratch: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
"""Gather buffers kept between buckets and exports (fresh memory costs a page fault per page every time)."""


def _buffers(length: int, dtype: torch.dtype, device: torch.device, count: int) -> list[torch.Tensor]:
    key = (length, dtype, device)
    if key not in _scratch:
        _scratch.clear()  # one size at a time: a bucket's
        _scratch[key] = [torch.empty(length, dtype=dtype, device=device) for _ in range(count)]
    return _scratch[key]


def _gather(bucket: list[_Part], into: Into | None, dtype: torch.dtype | None, rank: int, world: int) -> None:
    """Rank 0 casts its own rows straight into their places and receives every other rank's rows of the bucket
    in one buffer each; the others cast and pack theirs and send it."""
    out = dtype or bucket[0].tensor.dtype
    device = bucket[0].tensor.to_local().device
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the last bucket's copies out of the scratch buffers have landed
    offsets = [[0] * world for _ in bucket]  # offsets[i][r]: where part i starts in rank r's buffer
    ends = [0] * world
    for i, part in enumerate(bucket):
        for r in range(world):
            offsets[i][r] = ends[r]
            ends[r] += part.rows[r] * part.row_numel
    with torch.no_grad():
        locals_ = [part.tensor.to_local() for part in bucket]
        for part, local in zip(bucket, locals_, strict=True):
            if local.shape[0] != part.rows[rank]:
                raise RuntimeError(f"export: {part.name} holds {local.shape[0]} rows here; Shard(0) gives {part.rows}")
        if rank != 0:
            (mine,) = _buffers(ends[rank], out, device, 1)
            for i, local in enumerate(locals_):
                mine[offsets[i][rank] : offsets[i][rank] + local.numel()].copy_(local.reshape(-1))
            dist.send(mine, dst=0)
            return
        dests = [
            into(part.name, tuple(part.tensor.shape), out).view(-1) if into is not None else None for part in bucket
        ]
        for local, dest in zip(locals_, dests, strict=True):
            if dest is not None:  # rank 0's rows come first (Shard(0)), cast on the way
                dest[: local.numel()].copy_(local.reshape(-1), non_blocking=local.is_cuda)
        received = _buffers(max(ends[1:], default=0), out, device, world - 1)
        for r in range(1, world):
            dist.recv(received[r - 1][: ends[r]], src=r)
        for i, (part, dest) in enumerate(zip(bucket, dests, strict=True)):
            if dest is None:
                continue
            at = part.rows[0] * part.row_numel
            for r in range(1, world):  # rank r's rows follow rank r-1's
                n = part.rows[r] * part.row_numel
                piece = received[r - 1][offsets[i][r] : offsets[i][r] + n]
                dest[at : at + n].copy_(piece, non_blocking=piece.is_cuda)
                at += n
