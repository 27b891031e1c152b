"""Shared memory that other processes of this user read without a copy: where a version of weights is staged
once per host for every worker of an engine.

    segment = Segment(nbytes, name="weights")       # anonymous shared memory (memfd), mapped here
    buffer = segment.buffer                         # a uint8 tensor over all of it
    where = locate(buffer[4096:8192])               # (segment.path, 4096): what another process needs
    view = attach(where[0], segment.nbytes)         # in that process: the same bytes, mapped, not copied

A segment has no name in any file system: it is a `memfd`, and another process opens it by the creating
process's file descriptor (`/proc/PID/fd/N`, allowed to the same user). So nothing is left behind when a process
is killed (the kernel frees the memory with the last mapping), and nothing lands in /dev/shm or the run folder.
The memory lives while the segment or any tensor viewing it does; the descriptor (and with it the path) while the
`Segment` does.

`locate` answers for any tensor whose bytes lie inside a live segment (a view at any offset, in any dtype), so a
receiver can place whole buckets in segments and an engine can hand its workers their addresses instead of bytes.

Imports only the standard library at import time (torch inside the functions): vLLM's worker process imports it.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_live: dict[int, weakref.ref[Segment]] = {}
"""Live segments by the address of their first byte."""
_live_lock = threading.Lock()


class Segment:
    """`nbytes` of anonymous shared memory, mapped in this process; see the module docstring."""

    def __init__(self, nbytes: int, *, name: str = "rollart") -> None:
        import torch

        if nbytes < 0:
            raise ValueError(f"a segment of {nbytes} bytes")
        self.nbytes = nbytes
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, max(nbytes, 1))  # mmap refuses a length of 0
            mapping = mmap.mmap(self._fd, max(nbytes, 1))
        except OSError:
            os.close(self._fd)
            raise
        self.buffer: torch.Tensor = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
        """The whole segment; it (and every view of it) keeps the mapping alive."""
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        """What another process of this user opens (`attach`) while this segment lives."""
        self.address = self.buffer.data_ptr()
        with _live_lock:
            _live[self.address] = weakref.ref(self)
        self._closer = weakref.finalize(self, _forget, self.address, self._fd)

    def close(self) -> None:
        """Close the descriptor now (the path stops working); the memory goes with the last tensor viewing it."""
        self._closer()


def _forget(address: int, fd: int) -> None:
    with _live_lock:
        _live.pop(address, None)
    os.close(fd)


def locate(tensor: torch.Tensor) -> tuple[Segment, int] | None:
    """The live segment that holds all of contiguous CPU `tensor`'s bytes, and their offset in it; None if none
    does."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    with _live_lock:
        segments = [ref() for ref in _live.values()]
    for segment in segments:
        if segment is not None and segment.address <= start and end <= segment.address + segment.nbytes:
            return segment, start - segment.address
    return None


def attach(path: str, nbytes: int, *, writable: bool = False) -> mmap.mmap:
    """Map another process's segment (`Segment.path`); `ConnectionError` when that process (or the segment) is
    gone or smaller than `nbytes`. Read-only by default, as a private mapping: pages are shared until written, and
    this process never writes them. `writable`: a shared mapping whose writes the segment's owner sees (a training
    rank exporting weights into the trainer node's buffers)."""
    try:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    except OSError as error:
        raise ConnectionError(f"cannot open the shared weights at {path}: {error.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ConnectionError(f"the shared weights at {path} hold {size} bytes; expected {nbytes}")
        return mmap.mmap(fd, max(nbytes, 1), access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the mapping keeps the memory
