"""Receive buffers, reused as soon as nothing holds a tensor made from them.

Receiving into fresh memory costs ~4x receiving into memory used before: every page of a new
64 MiB buffer faults in (and is zeroed by the kernel), and freeing it unmaps it again. Measured
here over loopback TCP: 180-230 ms per 64 MiB into fresh `torch.empty` buffers, 40-60 ms into a
reused one. But `apply` may keep the tensors it was given (the transformers engine copies them
in later), so a buffer can only be reused once every tensor viewing it is gone.

How that is known without private torch APIs: each time a buffer is handed out it is wrapped in a
new numpy array, and every tensor `unpack_bucket` makes from it holds that array (tensor ->
`torch.frombuffer`'s memoryview -> array). The pool keeps the torch buffer and a weak reference to
the array: when the reference is dead, no tensor, memoryview or connection holds the buffer.

A pool for an engine whose workers are other processes (`shared=True`) takes its buffers from shared memory
(`rollart.shm`): a version's tensors then already lie where every worker can map them, and the engine hands them
addresses, not bytes.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from rollart.shm import Segment
from rollart.weights.buckets import new_buffer


class BufferPool:
    """Buffers for incoming buckets (`bulk_sink`); at most about `cap_bytes` of idle ones kept."""

    def __init__(self, *, shared: bool = False) -> None:
        self._shared = shared
        self._entries: list[tuple[torch.Tensor, weakref.ref[Any]]] = []
        self._segments: dict[int, Segment] = {}
        """A shared buffer's segment by the buffer's address: kept open while the pool keeps the buffer."""
        self.cap_bytes: int | None = None
        """Idle buffers beyond this many bytes (in use ones counted) are let go; None: no limit yet."""
        self.allocated = 0
        self.reused = 0

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly `nbytes`: an idle one of that size, or a new one."""
        buffer = next((b for b, handed in self._entries if handed() is None and b.numel() == nbytes), None)
        if buffer is None:
            buffer = self._new(nbytes)
            self.allocated += 1
        else:
            self.reused += 1
        array = buffer.numpy()
        # Most recently handed out last, so that `_trim` lets the least recently used go first.
        self._entries = [entry for entry in self._entries if entry[0] is not buffer]
        self._entries.append((buffer, weakref.ref(array)))
        self._trim()
        return array.data.cast("B")

    def _new(self, nbytes: int) -> torch.Tensor:
        if not self._shared:
            return new_buffer(nbytes)
        segment = Segment(nbytes, name="rollart-weights")
        self._segments[segment.address] = segment
        return segment.buffer

    def _trim(self) -> None:
        if self.cap_bytes is None:
            return
        total = sum(buffer.numel() for buffer, _ in self._entries)
        kept = []
        for entry in self._entries:
            if total > self.cap_bytes and entry[1]() is None:
                total -= entry[0].numel()
                if (segment := self._segments.pop(entry[0].data_ptr(), None)) is not None:
                    segment.close()
            else:
                kept.append(entry)
        self._entries = kept

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer, _ in self._entries)
