"""New weights for a running vLLM engine: checked against the checkpoint it loaded, then staged in shared memory
for every one of its workers.

vLLM runs the model in worker processes behind its engine-core process (one per GPU under tensor parallelism; on
CPU too), and a `collective_rpc`'s arguments take two hops to get there: msgpack from this process to the engine
core, decoded there without types, then pickle from the engine core to each worker. A torch tensor does not
survive the first hop and a memoryview not the second; `bytes` survive both but are copied four times on the way,
once per worker. So only a ticket goes through `collective_rpc`, and the bytes stay where they are: a version is
staged in shared memory (`rollart.shm`), one copy per host that every worker of every engine maps (`stage`). A
tensor that already lies in shared memory, as a view into a receive buffer of a `WeightReceiver(shared=True)`
does, is named where it lies, with no copy at all; any other is copied once into a segment of the engine's. The
worker (`rollart.generation.vllm.worker`) maps the segments and reloads the model in place.

The check is `rollart.generation.checks.check_weights` against the names and shapes of the model folder's
checkpoint. With tied embeddings vLLM keeps its own lm_head unless `lm_head.weight` is loaded (on CPU the head is
packed apart from the embeddings), so the worker loads the embeddings' tensor under that name too; the bytes are
staged once, whether or not the update carried `lm_head.weight`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollart.errors import RollartError
from rollart.generation.checks import check_weights
from rollart.generation.vllm.worker import WeightTicket
from rollart.shm import Segment, locate

if TYPE_CHECKING:
    import torch

_TIED_NAME = "lm_head.weight"
_EMBED_NAME = "model.embed_tokens.weight"
_ALIGN = 64
"""Each copied tensor starts at a multiple of this many bytes (any dtype's alignment)."""


class VLLMWeightsFailed(RollartError):
    """vLLM's worker did not load a version; the message says whether its weights are unchanged."""


def tied_aliases(tied: bool, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """{lm_head: embeddings} when the model ties them (config `tie_word_embeddings`) and has the embeddings."""
    return {_TIED_NAME: _EMBED_NAME} if tied and _EMBED_NAME in shapes else {}


def checked_tensors(
    version: int,
    weights: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
) -> list[tuple[str, torch.Tensor]]:
    """Check names and shapes against the checkpoint the engine loaded; the (name, tensor) pairs whose bytes go to
    the worker: every name but the aliases (loaded from their targets' bytes), each as contiguous CPU memory. A
    tensor that already is one (a view into a receive buffer, in any dtype) is sent as it is, without a copy."""
    check_weights(version, weights, shapes, aliases, equal=_equal)
    return [(name, _contiguous_cpu(tensor)) for name, tensor in weights.items() if name not in aliases]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()  # the tensor itself when it already is


@dataclass
class StagedVersion:
    """A version laid out where vLLM's workers can map it: the ticket for them, and the segments this engine made
    (kept open until every worker has mapped them)."""

    ticket: WeightTicket
    held: list[Segment]
    """Every segment the ticket names: held, so that none closes before the workers have mapped it."""
    made: list[Segment]
    copied_bytes: int
    """Bytes that did not lie in shared memory already and were copied into a segment of this engine's."""

    def close(self) -> None:
        for segment in self.made:
            segment.close()


def stage(version: int, tensors: list[tuple[str, torch.Tensor]], aliases: Mapping[str, str]) -> StagedVersion:
    """The ticket for `tensors` (contiguous CPU tensors): a tensor that lies in a live shared-memory segment (a
    view into a receive buffer of `WeightReceiver(shared=True)`) is named where it lies; the others are copied,
    once, into one new segment. Blocking: run it in a thread (the engine keeps decoding meanwhile)."""
    import numpy as np

    placed: list[tuple[Segment, int] | None] = [locate(tensor) for _, tensor in tensors]
    missing = [i for i, where in enumerate(placed) if where is None]
    made: list[Segment] = []
    copied = 0
    if missing:
        offsets, end = {}, 0
        for i in missing:
            end = -(-end // _ALIGN) * _ALIGN
            offsets[i] = end
            end += tensors[i][1].nbytes
        segment = Segment(end, name="rollart-staged-weights")
        made.append(segment)
        out = segment.buffer.numpy()
        for i, offset in offsets.items():
            raw = tensors[i][1].reshape(-1).view(torch_uint8()).numpy()
            np.copyto(out[offset : offset + raw.size], raw)  # one thread at memory speed (weights.buckets says why)
            placed[i] = (segment, offset)
            copied += raw.size
    held: list[Segment] = []
    entries = []
    for (name, tensor), where in zip(tensors, placed, strict=True):
        assert where is not None
        segment, offset = where
        if segment not in held:
            held.append(segment)
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append((name, dtype, tuple(tensor.shape), held.index(segment), offset))
    segments = [(segment.path, segment.nbytes) for segment in held]
    ticket = WeightTicket(version=version, segments=segments, tensors=entries, aliases=dict(aliases))
    return StagedVersion(ticket, held, made, copied)


def torch_uint8() -> torch.dtype:
    import torch

    return torch.uint8
