"""The vLLM engine's weight route without vLLM: the checks, staging in shared memory, and the workers' side of it
(`rollart.generation.vllm.worker.StagedWeights`), run in real worker processes of their own as vLLM's workers are,
with the ticket passed through msgpack and pickle as vLLM passes it. The route into a real engine, one worker and
two (tensor parallel), is tests/slow/test_vllm_streamed_weights.py and tests/slow/test_vllm_tp.py.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from rollart.generation.engine import WeightsMismatch
from rollart.generation.vllm.weights import checked_tensors, stage
from rollart.generation.vllm.worker import StagedWeights, WeightTicket, failures, map_tensors, with_aliases
from rollart.shm import Segment

TIED = {"lm_head.weight": "model.embed_tokens.weight"}
SHAPES = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,), "lm_head.weight": (8, 4)}


def through_vllm(ticket: WeightTicket) -> WeightTicket:
    """The ticket as the worker gets it: msgpack to the engine core, decoded without types, pickled to the worker."""
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ticket.to_rpc()))
    return WeightTicket.from_rpc(pickle.loads(pickle.dumps(decoded)))


def test_checked_tensors_sends_contiguous_tensors_as_they_are_and_tied_names_not_at_all() -> None:
    buffer = torch.zeros(64, dtype=torch.uint8)  # a receive buffer: the tensors are views into it
    embed = buffer[:64].view(torch.bfloat16).view(8, 4)
    norm = torch.arange(8.0)[::2]  # not contiguous
    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": norm, "lm_head.weight": embed}
    sent = dict(checked_tensors(1, weights, SHAPES, TIED))
    assert list(sent) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert sent["model.embed_tokens.weight"].data_ptr() == buffer.data_ptr()  # no copy, dtype kept
    assert sent["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sent["model.norm.weight"].is_contiguous() and torch.equal(sent["model.norm.weight"], norm)
    with pytest.raises(WeightsMismatch, match=r"lm_head\.weight is tied"):
        checked_tensors(1, {**weights, "lm_head.weight": embed + 1}, SHAPES, TIED)
    with pytest.raises(WeightsMismatch, match=r"missing: model\.norm\.weight"):
        checked_tensors(1, {"model.embed_tokens.weight": embed}, SHAPES, TIED)


def odd_weights() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.randn(8, 4).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4),
        "model.scale": torch.tensor(3.5, dtype=torch.float64),  # 0-d
        "model.empty": torch.zeros(0, 4),
        "model.steps": torch.arange(5, dtype=torch.int64),
    }


def test_a_staged_version_maps_whole_in_its_dtypes_and_tensors_in_shared_memory_are_not_copied() -> None:
    weights = odd_weights()
    received = Segment(1024)  # a receive buffer of a WeightReceiver(shared=True): the tensor is a view into it
    inside = received.buffer[256 : 256 + 32].view(torch.float32)
    inside.copy_(torch.arange(8.0))
    staged = stage(3, [*checked_tensors(3, weights, {}, TIED), ("model.inside", inside)], TIED)
    try:
        ticket = through_vllm(staged.ticket)
        assert ticket.version == 3 and len(ticket.segments) == 2
        assert staged.copied_bytes == sum(t.nbytes for t in weights.values())  # all but the one already shared
        assert ticket.tensors[-1][3:] == (ticket.segments.index((received.path, 1024)), 256)
        mapped = map_tensors(ticket)
    finally:
        staged.close()
    assert list(mapped) == [*weights, "model.inside"]
    for name, tensor in weights.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    assert torch.equal(mapped["model.inside"], torch.arange(8.0))
    inside.fill_(-1.0)  # a view of the same pages, not a copy of them
    assert torch.equal(mapped["model.inside"], torch.full((8,), -1.0))
    loaded = dict(with_aliases(mapped, ticket.aliases))
    assert loaded["lm_head.weight"] is mapped["model.embed_tokens.weight"]  # one tensor, staged once


def test_a_closed_segment_cannot_be_mapped_and_says_so() -> None:
    staged = stage(1, [("w", torch.ones(16))], {})
    staged.close()
    with pytest.raises(ConnectionError, match="cannot open the shared weights"):
        map_tensors(staged.ticket)


class TensorParallelWorker(StagedWeights):
    """A worker of rank `rank` of `world` whose model loader keeps its shard of each tensor's rows, as vLLM's
    column-parallel layers do: what `StagedWeights` drives in a real engine's worker."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.params: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights_iterator:
            rows = tensor.shape[0] // self.world
            self.params[name] = tensor[self.rank * rows : (self.rank + 1) * rows].clone()


def worker_process(rank: int, world: int, tickets: list[dict[str, Any]]) -> dict[str, Any]:
    """A worker's life in a process of its own: stage and swap each ticket; the shards it ends up with."""
    worker = TensorParallelWorker(rank, world)
    for ticket in tickets:
        worker.rollart_stage_weights(ticket)
        worker.rollart_swap_weights(ticket["version"])
    return {"params": worker.params, "pid": os.getpid()}


def test_tp_push_two_worker_processes_map_one_staged_copy_and_each_loads_its_shard() -> None:
    versions = {v: {"model.layer.weight": torch.randn(6, 4), "model.norm.weight": torch.randn(4)} for v in (1, 2)}
    staged = [stage(v, checked_tensors(v, w, {}, {}), {}) for v, w in versions.items()]
    tickets = [through_vllm(s.ticket).to_rpc() for s in staged]
    try:
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            results = pool.starmap(worker_process, [(rank, 2, tickets) for rank in range(2)])
    finally:
        for s in staged:
            s.close()
    assert len({result["pid"] for result in results}) == 2 and os.getpid() not in {r["pid"] for r in results}
    latest = versions[2]["model.layer.weight"]
    assert torch.equal(results[0]["params"]["model.layer.weight"], latest[:3])
    assert torch.equal(results[1]["params"]["model.layer.weight"], latest[3:])
    assert torch.equal(results[1]["params"]["model.norm.weight"], versions[2]["model.norm.weight"][2:])


def test_a_worker_answers_its_errors_instead_of_raising_them() -> None:
    worker = TensorParallelWorker(0, 1)
    assert worker.rollart_swap_weights(2) == {"error": "asked to swap in version 2, but this worker staged nothing"}
    staged = stage(1, [("w", torch.ones(4))], {})
    try:
        assert "error" not in worker.rollart_stage_weights(staged.ticket.to_rpc())
        assert "staged version 1" in worker.rollart_swap_weights(2)["error"]
    finally:
        staged.close()
    answer = worker.rollart_stage_weights(staged.ticket.to_rpc())  # closed: nothing to map
    assert answer["error"].startswith("ConnectionError: cannot open the shared weights")
    assert failures([{}, answer]) == [f"worker 1: {answer['error']}"]
    assert worker.params == {}  # nothing was loaded


def test_importing_the_vllm_engine_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, rollart.generation.vllm.engine\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
