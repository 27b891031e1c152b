"""VLLMEngine under LoRA with real vLLM: pushed adapters (PEFT's names, as the trainer exports them) served as
vLLM LoRA adapters; greedy output equal to PEFT's `merge_and_unload` model; a request in flight across an adapter
swap finishes on the adapter it started with, every token labelled with its version; adapters no request uses
any more are removed from vLLM and their folders deleted.

Needs vLLM: `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_lora.py -p no:cacheprovider -q`. One engine
serves the whole module, so the tests run in file order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollart.generation.engine import InvalidRequest, SamplingParams, WeightsMismatch
from rollart.generation.vllm.engine import VLLMEngine
from rollart.lora.spec import LoraSpec
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import build_engine_test_model, encoded_prompts, hf_greedy, until
from tests.lora_reference import SPEC, peft_adapters
from tests.slow.vllm_marks import vllm_engine_marks

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(300)

torch.set_num_threads(1)  # the engine's process needs the cores

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("vllm-lora") / "model")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return encoded_prompts(model_dir)


@pytest.fixture(scope="module")
def versions(model_dir: Path) -> dict[int, tuple[dict[str, torch.Tensor], torch.nn.Module]]:
    """Adapters and PEFT's merged model of versions 1 to 3."""
    return {version: peft_adapters(model_dir, seed=version, scale=0.3) for version in (1, 2, 3)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(model_dir, max_batch_size=16, max_model_len=1024, lora=SPEC)
    await engine.start()
    print(f"\nvLLM engine with LoRA started in {engine.start_seconds:.1f} s")
    yield engine
    held_folders = folders(engine).values()
    await engine.close()
    assert not any(folder.parent.exists() for folder in held_folders)  # the scratch folder went with the engine


def held(engine: VLLMEngine) -> list[int]:
    assert engine.adapters is not None
    return engine.adapters.held()


async def registered(engine: VLLMEngine) -> set[int]:
    """The LoRA adapter ids (version + 1) vLLM itself holds now."""
    return set(await engine._running_engine().list_loras())


def folders(engine: VLLMEngine) -> dict[int, Path]:
    assert engine.adapters is not None
    return engine.adapters.folders()


async def test_lora_the_base_first_then_pushed_adapters_decode_as_the_merged_model(
    engine: VLLMEngine,
    model_dir: Path,
    prompts: list[list[int]],
    versions: dict[int, tuple[dict[str, torch.Tensor], torch.nn.Module]],
) -> None:
    base, _ = load_model_and_tokenizer(model_dir)
    before = await asyncio.gather(*(engine.generate(f"b{i}", p, GREEDY) for i, p in enumerate(prompts)))
    assert [r.token_ids for r in before] == [hf_greedy(base, p, 24) for p in prompts]
    assert all(r.versions == [0] * 24 for r in before)

    adapters, merged = versions[1]
    started = time.monotonic()
    await engine.load_adapter(1, adapters, SPEC)
    print(f"\nload_adapter: {1000 * (time.monotonic() - started):.0f} ms")
    after = await asyncio.gather(*(engine.generate(f"v1-{i}", p, GREEDY) for i, p in enumerate(prompts)))
    assert [r.token_ids for r in after] == [hf_greedy(merged, p, 24) for p in prompts]
    assert all(r.versions == [1] * 24 for r in after)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert engine.version == engine.load().version == 1 and held(engine) == [1]


async def test_lora_a_request_in_flight_finishes_on_its_adapter_and_old_adapters_are_removed(
    engine: VLLMEngine,
    prompts: list[list[int]],
    versions: dict[int, tuple[dict[str, torch.Tensor], torch.nn.Module]],
) -> None:
    n = 900
    produced = engine.load().generated_tokens
    long = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=n, temperature=0)))
    await until(lambda: engine.load().generated_tokens > produced + 20)
    await engine.load_adapter(2, versions[2][0], SPEC)
    assert not long.done(), "the long request ended before the swap: make it longer"
    assert held(engine) == [1, 2]  # version 1 stays while the long request runs on it
    on_2 = await asyncio.gather(*(engine.generate(f"v2-{i}", p, GREEDY) for i, p in enumerate(prompts)))
    assert [r.token_ids for r in on_2] == [hf_greedy(versions[2][1], p, 24) for p in prompts]
    assert all(r.versions == [2] * 24 for r in on_2)
    folder_1 = folders(engine)[1]
    assert folder_1.is_relative_to("/dev/shm") and (folder_1 / "adapter_config.json").is_file()

    result = await long
    assert result.finish_reason == "length" and result.versions == [1] * n
    assert result.token_ids == hf_greedy(versions[1][1], prompts[1], n)
    assert held(engine) == [2] and not folder_1.exists()
    assert await registered(engine) == {3}  # vLLM's own list: version 2's id
    await engine.load_adapter(3, versions[3][0], SPEC)
    assert held(engine) == [3] and await registered(engine) == {4}


async def test_lora_whole_weights_and_adapters_that_do_not_fit_are_refused(
    engine: VLLMEngine, versions: dict[int, tuple[dict[str, torch.Tensor], torch.nn.Module]]
) -> None:
    adapters = versions[1][0]
    with pytest.raises(InvalidRequest, match="serves LoRA adapters"):
        await engine.load_weights(10, {})
    with pytest.raises(WeightsMismatch, match="target weights the model lacks"):
        await engine.load_adapter(10, {k.replace("self_attn", "attn"): v for k, v in adapters.items()}, SPEC)
    name = next(name for name in adapters if "lora_B" in name)
    with pytest.raises(WeightsMismatch, match="does not fit"):
        await engine.load_adapter(10, adapters | {name: adapters[name][:, :2]}, SPEC)
    with pytest.raises(InvalidRequest, match="ranks up to 8"):
        await engine.load_adapter(10, adapters, LoraSpec(rank=16))
    assert held(engine) == [3]
