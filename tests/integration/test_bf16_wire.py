"""The generators' dtype on the wire: a trainer's fp32 weights pushed over loopback TCP to a bf16
generator arrive as exactly `tensor.to(torch.bfloat16)`, tied embeddings travel once, and the
generator then decodes greedily what a bf16 model loaded directly from those weights decodes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from rollart.generation.engine import SamplingParams
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from rollart.protocol import CONTROL, Identity, SessionConfig, SessionServer
from rollart.weights.config import WeightsSpec
from rollart.weights.publisher import WeightPublisher
from rollart.weights.receiver import WeightReceiver
from tests.engine_reference import PROMPTS, build_engine_test_model, noisy_weights

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

SECRET = b"bf16 wire"
CFG = SessionConfig(handshake_timeout_s=2.0)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


class _NoMessages:
    async def on_event(self, session: Any, msg: Any) -> None:
        raise AssertionError(f"unexpected event {msg!r}")

    async def on_request(self, session: Any, msg: Any) -> Any:
        raise AssertionError(f"unexpected request {msg!r}")


async def greedy(engine: HFEngine, prompts: list[list[int]]) -> list[list[int]]:
    results = [await engine.generate(f"p{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
    return [result.token_ids for result in results]


@pytest.mark.timeout(120)
async def test_bf16_wire_fp32_weights_arrive_as_their_bf16_cast_and_decode_like_a_bf16_model(tmp_path: Path) -> None:
    model_dir = build_engine_test_model(tmp_path / "start")
    trainer_model, tokenizer = load_model_and_tokenizer(model_dir)  # fp32, tied embeddings
    trainer_model.load_state_dict(noisy_weights(trainer_model, seed=7, scale=0.05), strict=False)
    trained = trainer_model.state_dict()  # what the trainer exports: lm_head.weight is the embeddings
    assert trained["lm_head.weight"].data_ptr() == trained["model.embed_tokens.weight"].data_ptr()
    assert all(t.dtype == torch.float32 for t in trained.values())
    prompts = [tokenizer.encode(text) for text in PROMPTS]

    engine = HFEngine(model_dir, dtype=torch.bfloat16)
    await engine.start()
    arrived: dict[str, torch.Tensor] = {}

    async def apply(version: int, weights: dict[str, torch.Tensor]) -> None:
        arrived.update(weights)
        await engine.load_weights(version, weights)

    receiver = WeightReceiver(apply, dtype=torch.bfloat16)
    generator = Identity("gen-0", "generator")
    server = SessionServer(
        local=generator, secret=SECRET, channel=CONTROL, handler=_NoMessages(), cfg=CFG, on_bulk=receiver.on_bulk
    )
    publisher = WeightPublisher(Identity("trainer", "trainer"), SECRET, CFG, WeightsSpec(transport="tcp"))
    try:
        async with asyncio.timeout(90), asyncio.TaskGroup() as tg:
            tg.create_task(server.serve())
            port = (await server.listen_tcp("127.0.0.1", 0)).sockets[0].getsockname()[1]
            publisher.add_target("gen-0", "127.0.0.1", port, dtype=torch.bfloat16)
            tg.create_task(publisher.run())
            publisher.publish(1, trained)
            await publisher.wait_delivered(1, timeout=60)
            pushed = await greedy(engine, prompts)
            await publisher.close()
            await server.close()
    finally:
        await engine.close()

    assert arrived.keys() == trained.keys()
    for name, tensor in trained.items():
        assert arrived[name].dtype == torch.bfloat16
        assert torch.equal(arrived[name], tensor.to(torch.bfloat16)), name
    assert arrived["lm_head.weight"].data_ptr() == arrived["model.embed_tokens.weight"].data_ptr()
    once = sum(t.numel() * 2 for name, t in trained.items() if name != "lm_head.weight")
    assert publisher.egress_bytes < once + 64 * len(trained)  # bf16, the tied pair once (plus alignment)

    direct_dir = tmp_path / "direct"
    trainer_model.save_pretrained(direct_dir)
    tokenizer.save_pretrained(direct_dir)
    direct = HFEngine(direct_dir, dtype=torch.bfloat16)  # the same weights, loaded as bf16 from disk
    await direct.start()
    try:
        assert pushed == await greedy(direct, prompts)
    finally:
        await direct.close()
