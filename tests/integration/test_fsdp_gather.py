"""`rollart.training.fsdp.gather.whole_tensors` on 2 real gloo ranks: bucketed gathers give exactly what
`full_tensor()` gives, in the wire dtype, for shapes that do not split evenly (5 rows, 1 row, a vector), across
bucket boundaries, with a plain tensor among the sharded ones, each written straight into rank 0's destination."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollart.testkit.ports import free_ports

pytestmark = pytest.mark.integration

SHAPES = {"a": (5, 3), "b": (1, 4), "c": (4,), "d": (7, 2, 2), "e": (3, 8)}


def rank_main(rank: int, port: int, out: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from rollart.training.fsdp.gather import whole_tensors

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # the same whole tensors on both ranks, each keeping its rows
    whole = {name: torch.randn(shape) for name, shape in SHAPES.items()}
    named = [(name, distribute_tensor(t, mesh, [Shard(0)])) for name, t in whole.items()]
    named.insert(2, ("plain", torch.arange(6.0)))
    expected = [(name, t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in named]
    got: list[tuple[str, torch.Tensor]] = []

    def into(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        got.append((name, torch.full(shape, float("nan"), dtype=dtype)))
        return got[-1][1]

    whole_tensors(named, into if rank == 0 else None, dtype=torch.bfloat16, bucket_bytes=40, rank=rank, world=2)
    if rank == 0:
        torch.save({"got": got, "expected": expected}, out)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_bucketed_gathers_equal_full_tensor_in_the_wire_dtype(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    out = tmp_path / "rank0.pt"
    mp.spawn(rank_main, args=(port, str(out)), nprocs=2, join=True)
    result = torch.load(out)
    assert [name for name, _ in result["got"]] == [name for name, _ in result["expected"]]
    for (name, got), (_, expected) in zip(result["got"], result["expected"], strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16)), name
