"""The transformers engine under LoRA: pushed adapters (PEFT's names, as the trainer exports them) merged into the
base it loaded; greedy output equal to PEFT's own `merge_and_unload` model; a later version replaces the earlier
one instead of adding to it; every token labelled with the adapter version that generated it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rollart.generation.engine import InvalidRequest, SamplingParams, WeightsMismatch
from rollart.generation.engine_set import EngineSet
from rollart.generation.hf.engine import HFEngine
from rollart.generation.vllm.lora import vllm_lora_rank
from rollart.lora.spec import LoraSpec
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import build_engine_test_model, encoded_prompts, hf_greedy
from tests.lora_reference import SPEC, peft_adapters

torch.set_num_threads(1)

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("hf-lora") / "model")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return encoded_prompts(model_dir)


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HFEngine]:
    engine = HFEngine(model_dir, max_batch_size=8)
    await engine.start()
    yield engine
    await engine.close()


async def greedy(engine: HFEngine, prompts: list[list[int]], tag: str) -> list[tuple[list[int], list[int]]]:
    results = [await engine.generate(f"{tag}-{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
    return [(result.token_ids, result.versions) for result in results]


async def test_lora_adapters_merged_in_give_the_greedy_output_of_peft_merge_and_unload(
    engine: HFEngine, model_dir: Path, prompts: list[list[int]]
) -> None:
    base, _ = load_model_and_tokenizer(model_dir)
    adapters, merged = peft_adapters(model_dir, seed=1, scale=0.3)
    before = await greedy(engine, prompts, "base")
    assert [tokens for tokens, _ in before] == [hf_greedy(base, p, MAX_TOKENS) for p in prompts]

    await engine.load_adapter(1, adapters, SPEC)
    after = await greedy(engine, prompts, "v1")
    expected = [hf_greedy(merged, p, MAX_TOKENS) for p in prompts]
    assert [tokens for tokens, _ in after] == expected
    assert all(versions == [1] * len(tokens) for tokens, versions in after)
    assert expected != [tokens for tokens, _ in before]  # the adapters do change what the model says
    assert engine.version == 1 and engine.load().version == 1


async def test_lora_a_second_version_replaces_the_first_instead_of_adding_to_it(
    engine: HFEngine, model_dir: Path, prompts: list[list[int]]
) -> None:
    first, _ = peft_adapters(model_dir, seed=1, scale=0.3)
    # Version 2 adapts fewer modules: k_proj and o_proj, which version 1 changed, must be the base's again.
    spec_2 = LoraSpec(rank=SPEC.rank, alpha=SPEC.alpha, target_modules=["q_proj", "v_proj"])
    second, merged_2 = peft_adapters(model_dir, spec_2, seed=2, scale=0.3)
    await engine.load_adapter(1, first, SPEC)
    await greedy(engine, prompts[:1], "v1")
    await engine.load_adapter(2, second, spec_2)
    after = await greedy(engine, prompts, "v2")
    assert [tokens for tokens, _ in after] == [hf_greedy(merged_2, p, MAX_TOKENS) for p in prompts]
    assert all(versions == [2] * len(tokens) for tokens, versions in after)


async def test_lora_a_request_in_flight_across_an_adapter_swap_labels_each_token_with_its_version(
    engine: HFEngine, model_dir: Path, prompts: list[list[int]]
) -> None:
    adapters, _ = peft_adapters(model_dir, seed=1, scale=0.3)
    n = 1000  # the test model never samples EOS: the request runs to its max_tokens (long enough that the
    # swap lands inside it on a loaded machine too: with 200, a full test run once saw it finish first)
    request = asyncio.create_task(engine.generate("long", prompts[0], SamplingParams(max_tokens=n, temperature=0)))
    for _ in range(100_000):
        if engine.load().running:
            break
        await asyncio.sleep(0)
    await engine.load_adapter(1, adapters, SPEC)
    result = await request
    cut = result.versions.index(1)
    assert 0 < cut < n and result.versions == [0] * cut + [1] * (n - cut), result.versions


async def test_lora_adapters_that_do_not_fit_the_model_are_refused(engine: HFEngine, model_dir: Path) -> None:
    adapters, _ = peft_adapters(model_dir, seed=1)
    renamed = {name.replace("self_attn", "attention"): tensor for name, tensor in adapters.items()}
    with pytest.raises(WeightsMismatch, match="target weights the model lacks"):
        await engine.load_adapter(1, renamed, SPEC)
    a_only = {name: tensor for name, tensor in adapters.items() if "lora_A" in name}
    with pytest.raises(WeightsMismatch, match="not both lora_A and lora_B"):
        await engine.load_adapter(1, a_only, SPEC)
    name = next(name for name in adapters if "lora_B" in name)
    with pytest.raises(WeightsMismatch, match="does not fit"):
        await engine.load_adapter(1, adapters | {name: adapters[name][:, :2]}, SPEC)
    await engine.load_adapter(1, adapters, SPEC)
    with pytest.raises(InvalidRequest, match="serves adapters: it cannot also load weights"):
        await engine.load_weights(2, {})
    with pytest.raises(InvalidRequest, match="not newer"):
        await engine.load_adapter(1, adapters, SPEC)


async def test_lora_an_engine_set_loads_each_version_into_every_engine(
    model_dir: Path, prompts: list[list[int]]
) -> None:
    adapters, merged = peft_adapters(model_dir, seed=1, scale=0.3)
    engines = EngineSet([HFEngine(model_dir, max_batch_size=4) for _ in range(2)])
    await engines.start()
    try:
        await engines.load_adapter(1, adapters, SPEC)
        results = [await engine.generate("r", prompts[0], GREEDY) for engine in engines.engines]
    finally:
        await engines.close()
    assert [r.token_ids for r in results] == [hf_greedy(merged, prompts[0], MAX_TOKENS)] * 2
    assert engines.load().version == 1


def test_lora_vllm_serves_a_rank_at_the_next_max_lora_rank_it_takes() -> None:
    assert [vllm_lora_rank(rank) for rank in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(InvalidRequest, match="up to 512"):
        vllm_lora_rank(513)
