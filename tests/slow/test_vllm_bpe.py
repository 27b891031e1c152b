"""The BPE test model (Qwen3's architecture, template and special tokens) served by real vLLM on CPU: multi-turn
FrozenLake trajectories with thinking on and off, each way of showing the model its history, trained on by the
torch trainer. vLLM runs the checkpoint's own dtype (bf16) and stops on the model's own stop tokens.

Needs vLLM: `bin/setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_bpe.py -q`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollart.generation.vllm.engine import VLLMEngine
from rollart.models.checkpoint import engine_dtype
from tests.slow.vllm_marks import vllm_engine_marks
from tests.unit.test_bpe_rollout import check_and_train, lake, play

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(300)

torch.set_num_threads(1)  # the engine's process needs the cores


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(qwen3_bpe_dir: Path) -> AsyncIterator[VLLMEngine]:
    dtype = engine_dtype("auto", qwen3_bpe_dir, on_gpu=False)
    assert dtype == "bfloat16"  # the checkpoint's
    engine = VLLMEngine(qwen3_bpe_dir, max_batch_size=16, dtype=dtype, max_model_len=1024)
    await engine.start()
    yield engine
    await engine.close()


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("context", ["full", "template"])
async def test_thinking_on_and_off_multi_turn_through_vllm_and_the_trainer(
    engine: VLLMEngine, qwen3_bpe_dir: Path, thinking: bool, context: str
) -> None:
    assert engine._max_model_len == 1024  # the topology's max_model_len reached vLLM
    task = lake(thinking=thinking, context=context)
    trajectories, proxy = await play(engine, qwen3_bpe_dir, task, n=4)
    check_and_train(qwen3_bpe_dir, task, trajectories, proxy)
