"""Runs inside vLLM's worker process: takes one version of weights streamed from the `VLLMEngine` that owns the
worker, and loads it into the model in place.

vLLM mixes `StreamedWeights` into its worker class (the engine argument `worker_extension_cls` names it), so
`collective_rpc(LOAD_METHOD, args=(ticket,))` runs `rollart_load_streamed_weights` in the worker, between two
engine steps. The ticket (`WeightTicket`, sent as a plain dict: it crosses vLLM's msgpack and pickle hops) says
where to connect, the one-time token to present, and the name, dtype and shape of each tensor in the order their
bytes come. The worker then:

1. connects to the engine's loopback port, sends the token, and reads every tensor's bytes straight into a tensor
   of its own (`recv_into`: one copy, socket to tensor). A failure here leaves the model as it was;
2. hands the tensors, with each tied name (lm_head) mapped to its target's tensor, to vLLM's in-place reload,
   `Worker.reload_weights(weights_iterator=...)`. That runs the model class's own `load_weights` (which fills the
   stacked qkv/gate_up parameters and converts the dtype) inside vLLM's layerwise reload, which redoes each
   layer's post-load processing. On CPU that processing packs the linear weights for oneDNN and empties
   `layer.weight`, so the model's `load_weights` alone would fail on a running engine; the layerwise reload
   restores each layer, loads it and packs it again.

Nothing is written to a file on the way. The tensors live until the function returns.

Imported by vLLM in its worker process, and by the engine's side for the names and the ticket: only the standard
library at import time, torch inside the functions (the engine's modules import no torch until it runs).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LOAD_METHOD = "rollart_load_streamed_weights"
"""The worker method `VLLMEngine.load_weights` calls through `collective_rpc`."""
EXTENSION = f"{__name__}.StreamedWeights"
"""What `worker_extension_cls` names."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightTicket:
    """Where a version's bytes wait and what they are; handed to the worker as `to_rpc()`'s dict."""

    host: str
    port: int
    token: bytes
    """One-time secret the worker sends first: only the worker that got this ticket gets the weights."""
    tensors: list[tuple[str, str, tuple[int, ...]]]
    """(HF name, dtype name without `torch.`, shape), in the order their bytes come."""
    aliases: dict[str, str]
    """A name loaded from another name's tensor (tied `lm_head.weight` from the embeddings): sent once."""
    timeout_s: float
    """Longest wait for the connection and for each read."""

    def to_rpc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_rpc(cls, fields: dict[str, Any]) -> WeightTicket:
        """Back from the dict: msgpack turns the tuples into lists on the way."""
        return cls(
            host=str(fields["host"]),
            port=int(fields["port"]),
            token=bytes(fields["token"]),
            tensors=[(str(name), str(dtype), tuple(int(n) for n in shape)) for name, dtype, shape in fields["tensors"]],
            aliases={str(alias): str(name) for alias, name in fields["aliases"].items()},
            timeout_s=float(fields["timeout_s"]),
        )


def dtype_named(name: str) -> torch.dtype:
    """`torch.<name>`, refusing anything that is not a dtype."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor of any dtype, without a copy (writable when the tensor is)."""
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data.cast("B")


def receive_tensors(ticket: WeightTicket) -> dict[str, torch.Tensor]:
    """Connect, present the token, and read every tensor of the ticket into a new tensor, in order."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    with socket.create_connection((ticket.host, ticket.port), timeout=ticket.timeout_s) as sock:
        sock.sendall(ticket.token)
        for name, dtype, shape in ticket.tensors:
            tensor = torch.empty(shape, dtype=dtype_named(dtype))
            view = byte_view(tensor)
            while view:
                got = sock.recv_into(view)
                if got == 0:
                    raise ConnectionError(f"the engine closed the connection in the middle of {name}")
                view = view[got:]
            tensors[name] = tensor
    return tensors


def with_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) to load: the received ones, then each alias with its target's tensor (no copy)."""
    yield from tensors.items()
    for alias, name in aliases.items():
        yield alias, tensors[name]


class StreamedWeights:
    """Mixed into vLLM's worker class (`worker_extension_cls`): `self` is the worker."""

    def rollart_load_streamed_weights(self, ticket: dict[str, Any]) -> dict[str, float]:
        """Receive one version (see the module docstring) and reload the model with it in place."""
        parsed = WeightTicket.from_rpc(ticket)
        started = time.perf_counter()
        try:
            tensors = receive_tensors(parsed)
        except Exception as error:  # raised again, saying what it means for the model
            raise RuntimeError(f"receiving the weights failed; the model's weights are unchanged: {error!r}") from error
        received = time.perf_counter()
        worker: Any = self
        worker.reload_weights(weights_iterator=with_aliases(tensors, parsed.aliases))
        return {
            "tensors": float(len(tensors)),
            "bytes": float(sum(t.nbytes for t in tensors.values())),
            "receive_s": received - started,
            "reload_s": time.perf_counter() - received,
        }
