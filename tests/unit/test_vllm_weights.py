"""The vLLM engine's weight route without vLLM: the checks, the offer on a loopback port, and the worker's side of
it (`rollart.generation.vllm.worker.receive_tensors`, run here in a thread as vLLM's worker would run it), with the
ticket passed through msgpack and pickle as vLLM passes it. The route into a real engine is
tests/slow/test_vllm_streamed_weights.py.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from rollart.generation.engine import WeightsMismatch
from rollart.generation.vllm.weights import WeightOffer, checked_tensors
from rollart.generation.vllm.worker import WeightTicket, receive_tensors, with_aliases

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


async def test_a_version_offered_on_the_port_arrives_whole_in_its_dtypes() -> None:
    weights = {
        "model.embed_tokens.weight": torch.randn(8, 4).to(torch.bfloat16),
        "model.norm.weight": torch.randn(4),
        "model.scale": torch.tensor(3.5, dtype=torch.float64),  # 0-d
        "model.empty": torch.zeros(0, 4),
        "model.steps": torch.arange(5, dtype=torch.int64),
    }
    tensors = checked_tensors(1, weights, {}, TIED)
    with WeightOffer(tensors, TIED, timeout_s=10) as offer:
        ticket = through_vllm(offer.ticket)
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            tg.create_task(offer.send())
            received = await asyncio.to_thread(receive_tensors, ticket)
    assert list(received) == list(weights)
    for name, tensor in weights.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    loaded = dict(with_aliases(received, ticket.aliases))
    assert loaded["lm_head.weight"] is received["model.embed_tokens.weight"]  # one tensor, sent once
    assert offer.refused == 0


async def test_a_connection_without_the_token_is_refused_and_the_worker_still_gets_the_weights() -> None:
    weights = {"model.norm.weight": torch.randn(1000)}
    with WeightOffer(checked_tensors(1, weights, {}, {}), {}, timeout_s=10) as offer:
        ticket = through_vllm(offer.ticket)

        def impostor() -> bytes:
            with socket.create_connection((ticket.host, ticket.port), timeout=10) as sock:
                sock.sendall(b"x" * len(ticket.token))
                return sock.recv(1)  # b"": closed without a byte of the weights

        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            sending = tg.create_task(offer.send())
            assert await asyncio.to_thread(impostor) == b""
            received = await asyncio.to_thread(receive_tensors, ticket)
    assert sending.done() and offer.refused == 1
    assert torch.equal(received["model.norm.weight"], weights["model.norm.weight"])


def test_importing_the_vllm_engine_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, rollart.generation.vllm.engine\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr
