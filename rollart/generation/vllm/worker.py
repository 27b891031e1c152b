"""Runs inside each of vLLM's worker processes: maps one version of weights staged in shared memory by the
`VLLMEngine` that owns the worker, then swaps it into the model in place.

vLLM mixes `StagedWeights` into its worker class (the engine argument `worker_extension_cls` names it), and the
engine calls it through `collective_rpc`, which runs a method on every worker of the engine (one per GPU under
tensor parallelism), between two engine steps. The ticket (`WeightTicket`, sent as a plain dict: it crosses vLLM's
msgpack and pickle hops) names the shared-memory segments the version lies in (`rollart.shm`: the receive buffers
themselves, or one segment the engine copied into) and each tensor's name, dtype, shape, segment and offset. A
version is applied in two calls, so that it reaches all workers or none:

1. `STAGE_METHOD`: every worker maps the segments and makes its tensors, views of the shared bytes (no copy;
   the pages are the host's one copy, whatever the number of workers). A failure here, on any worker, leaves every
   model as it was: the engine then calls `DROP_METHOD` and reports the version as not loaded.
2. `SWAP_METHOD`: every worker hands its staged tensors, with each tied name (lm_head) mapped to its target's
   tensor, to vLLM's in-place reload, `Worker.reload_weights(weights_iterator=...)`. That runs the model class's
   own `load_weights` (which takes each worker's shard of a tensor-parallel weight, fills the stacked qkv/gate_up
   parameters and converts the dtype) inside vLLM's layerwise reload, which redoes each layer's post-load
   processing. On CPU that processing packs the linear weights for oneDNN and empties `layer.weight`, so the
   model's `load_weights` alone would fail on a running engine; the layerwise reload restores each layer, loads it
   and packs it again. Only this step pauses decoding.

Nothing is written to a file on the way, and the mappings go when the swap (or the drop) returns.

Imported by vLLM in its worker process, and by the engine's side for the names and the ticket: only the standard
library at import time, torch inside the functions (the engine's modules import no torch until it runs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rollart.shm import attach

if TYPE_CHECKING:
    import torch

STAGE_METHOD = "rollart_stage_weights"
"""Map a version's segments (`WeightTicket`) and keep its tensors for the swap."""
SWAP_METHOD = "rollart_swap_weights"
"""Load the staged version into the model in place."""
DROP_METHOD = "rollart_drop_staged_weights"
"""Forget a staged version (another worker could not stage it)."""
EXTENSION = f"{__name__}.StagedWeights"
"""What `worker_extension_cls` names."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightTicket:
    """Where a version's bytes lie and what they are; handed to every worker as `to_rpc()`'s dict."""

    version: int
    segments: list[tuple[str, int]]
    """(path another process opens, bytes) of each shared-memory segment (`rollart.shm.Segment`)."""
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]
    """(HF name, dtype name without `torch.`, shape, index into `segments`, byte offset in it)."""
    aliases: dict[str, str]
    """A name loaded from another name's tensor (tied `lm_head.weight` from the embeddings): staged once."""

    def to_rpc(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_rpc(cls, fields: dict[str, Any]) -> WeightTicket:
        """Back from the dict: msgpack turns the tuples into lists on the way."""
        return cls(
            version=int(fields["version"]),
            segments=[(str(path), int(nbytes)) for path, nbytes in fields["segments"]],
            tensors=[
                (str(name), str(dtype), tuple(int(n) for n in shape), int(segment), int(offset))
                for name, dtype, shape, segment, offset in fields["tensors"]
            ],
            aliases={str(alias): str(name) for alias, name in fields["aliases"].items()},
        )


def dtype_named(name: str) -> torch.dtype:
    """`torch.<name>`, refusing anything that is not a dtype."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def map_tensors(ticket: WeightTicket) -> dict[str, torch.Tensor]:
    """Every tensor of the ticket, a view of its segment's shared bytes (no copy); `ConnectionError` when a
    segment is gone, `ValueError` when a tensor does not lie inside its segment."""
    import torch

    maps = [attach(path, nbytes) for path, nbytes in ticket.segments]
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape, index, offset in ticket.tensors:
        dtype = dtype_named(dtype_name)
        count = 1
        for n in shape:
            count *= n
        nbytes = count * dtype.itemsize
        if not 0 <= index < len(maps) or offset < 0 or offset + nbytes > ticket.segments[index][1]:
            raise ValueError(f"{name}: {nbytes} bytes at {offset} do not lie inside segment {index}")
        if offset % dtype.itemsize:
            raise ValueError(f"{name}: offset {offset} is not aligned to its dtype {dtype_name}")
        if count == 0:  # frombuffer refuses an empty view
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        tensors[name] = torch.frombuffer(maps[index], dtype=dtype, count=count, offset=offset).view(shape)
    return tensors


def with_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) to load: the staged ones, then each alias with its target's tensor (no copy)."""
    yield from tensors.items()
    for alias, name in aliases.items():
        yield alias, tensors[name]


class StagedWeights:
    """Mixed into vLLM's worker class (`worker_extension_cls`): `self` is the worker.

    Each method answers a dict and never raises: it says `{"error": ...}` instead. vLLM's multiprocess executor
    raises on the first worker that fails a `collective_rpc` without reading the other workers' answers, which then
    stay queued and are read as the answers to the next calls (vLLM 0.32, `MultiprocExecutor.collective_rpc`), so
    one raising worker would leave every later call of a tensor-parallel engine answered out of turn."""

    _rollart_staged: tuple[WeightTicket, dict[str, torch.Tensor]] | None = None

    def rollart_stage_weights(self, ticket: dict[str, Any]) -> dict[str, Any]:
        """Map one version (step 1 of the module docstring); the model is not touched."""
        started = time.perf_counter()
        self._rollart_staged = None
        try:
            parsed = WeightTicket.from_rpc(ticket)
            self._rollart_staged = parsed, map_tensors(parsed)
        except Exception as error:  # answered, not raised: see the class docstring
            return {"error": f"{type(error).__name__}: {error}"}
        return {"tensors": len(parsed.tensors), "stage_s": time.perf_counter() - started}

    def rollart_swap_weights(self, version: int) -> dict[str, Any]:
        """Load the staged version into the model in place (step 2); refuses one other than `version`."""
        staged, self._rollart_staged = self._rollart_staged, None
        if staged is None or staged[0].version != version:
            held = "nothing" if staged is None else f"version {staged[0].version}"
            return {"error": f"asked to swap in version {version}, but this worker staged {held}"}
        ticket, tensors = staged
        started = time.perf_counter()
        worker: Any = self
        try:
            worker.reload_weights(weights_iterator=with_aliases(tensors, ticket.aliases))
        except Exception as error:  # answered, not raised: see the class docstring
            return {"error": f"{type(error).__name__}: {error}", "swapping": True}
        return {
            "tensors": len(tensors),
            "bytes": sum(t.nbytes for t in tensors.values()),
            "swap_s": time.perf_counter() - started,
        }

    def rollart_drop_staged_weights(self) -> dict[str, Any]:
        """Forget what was staged (its mappings go with it)."""
        self._rollart_staged = None
        return {}


def failures(answers: object) -> list[str]:
    """The errors in `collective_rpc`'s answers from every worker (`StagedWeights`' dicts), each with its rank."""
    if not isinstance(answers, list):
        return [f"unexpected answer {answers!r}"]
    return [f"worker {rank}: {answer['error']}" for rank, answer in enumerate(answers) if answer.get("error")]
