"""The receiving half every `Connection` shares: a queue of frames and the two ways to take one.

A connection queues what arrives in order: a message frame as `bytes`, a bulk frame's payload as a
`Bulk`. `FrameReceiver` takes the next one (`_next`, each transport's own wait) for `recv` or
`recv_bulk`, and refuses a frame of the other kind: TCP (`framing.py`), in-memory (`memory.py`) and
UCX (`rollart.weights.ucx`) all answer a mix-up the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from rollart.protocol.errors import ProtocolError


class Bulk:
    """A received bulk frame's payload, waiting in the queue among message frames."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view


class FrameReceiver(ABC):
    """`recv` and `recv_bulk` over a transport's `_next`."""

    @abstractmethod
    async def _next(self) -> bytes | Bulk:
        """The next frame received, waiting for one; the connection's error once none will come."""

    async def recv(self) -> bytes:
        item = await self._next()
        if isinstance(item, Bulk):
            raise ProtocolError("expected a message frame; got a bulk frame")
        return item

    async def recv_bulk(self) -> memoryview:
        item = await self._next()
        if not isinstance(item, Bulk):
            raise ProtocolError("expected a bulk frame; got a message frame")
        return item.view
