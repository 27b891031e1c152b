"""CUDA IPC between two processes of one host (`rollart.weights.cuda_ipc`), on a GPU (skipped without one).

A child process fills a buffer on the GPU and shares it (`share`: handles and sizes, sent as msgspec bytes); this
process opens it (`open_shared`), copies it device to device into a buffer of its own and checks every byte; the
child changes nothing until told the copy is done. `bin/gpu-check` runs this file on the lent GPU, where both
processes use the one device; its table measures the copy's rate (the `cuda_ipc` row).
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection as Pipe

import msgspec
import pytest
import torch

from rollart.weights.cuda_ipc import SharedCuda, open_shared, share

pytestmark = pytest.mark.integration
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bin/gpu-check runs it on one)")

NBYTES = 64 << 20


def pattern(nbytes: int, device: str) -> torch.Tensor:
    return (torch.arange(nbytes, device=device, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def owner(pipe: Pipe, nbytes: int) -> None:
    buffer = pattern(nbytes, "cuda")[1:]  # a view at an offset into its storage, as a bucket in a bigger buffer is
    torch.cuda.synchronize()
    pipe.send_bytes(msgspec.msgpack.encode(share(buffer)))
    assert pipe.recv() == "copied"
    pipe.send(int(buffer.sum(dtype=torch.int64)))


@needs_cuda
def test_cuda_ipc_a_buffer_shared_by_another_process_is_copied_device_to_device() -> None:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=owner, args=(theirs, NBYTES + 1))
    child.start()
    try:
        assert ours.poll(120), f"the owner sent no handle (exit code {child.exitcode})"
        shared = msgspec.msgpack.decode(ours.recv_bytes(), type=SharedCuda)
        assert shared.nbytes == NBYTES and shared.offset == 1
        staged = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
        view = open_shared(shared)
        staged.copy_(view)
        torch.cuda.synchronize()
        del view
        ours.send("copied")
        assert torch.equal(staged, pattern(NBYTES + 1, "cuda")[1:])
        assert ours.poll(60) and ours.recv() == int(staged.sum(dtype=torch.int64))  # the owner's bytes, unchanged
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_cuda_ipc_refuses_what_it_cannot_share() -> None:
    with pytest.raises(ValueError, match="1-D contiguous uint8 CUDA tensor"):
        share(torch.zeros(4, dtype=torch.uint8))
