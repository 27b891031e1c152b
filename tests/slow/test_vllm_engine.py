"""VLLMEngine on the tiny model with real vLLM: greedy and log-prob exactness against transformers, 16 concurrent
requests, abort and cancel, a weight swap under a request in flight, close.

Needs vLLM, which lives in its own environment: `bin/setup-vllm`, then
`.venv-vllm/bin/python -m pytest tests/slow/test_vllm_engine.py -p no:cacheprovider -q`.
One engine serves the whole module (vLLM takes 20-50 s to start on a small CPU), so the tests run in file order:
the weight swap comes after the tests that compare with the original weights, and closing comes last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollart.generation.engine import EngineClosed, InvalidRequest, SamplingParams, WeightsMismatch
from rollart.generation.vllm.engine import VLLMEngine
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import (
    PROMPTS,
    build_engine_test_model,
    hf_greedy,
    importance_ratios,
    noisy_weights,
    until,
)
from tests.slow.vllm_marks import vllm_engine_marks

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(240)

torch.set_num_threads(1)  # the engine's process needs the cores

LONG_PROMPT = "A long prompt, so that whole blocks of it land in the prefix cache. " * 5
"""340 tokens: two whole KV-cache blocks (128 tokens on CPU), which a later request with it reuses. The short
prompts fill no block, so they are never cached."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("vllm-engine") / "model")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    _, tokenizer = load_model_and_tokenizer(model_dir)
    return [tokenizer.encode(text) for text in [*PROMPTS, LONG_PROMPT]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(model_dir, max_batch_size=64)
    await engine.start()
    print(f"\nvLLM engine started in {engine.start_seconds:.1f} s")
    yield engine
    await engine.close()


def teacher_forced_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()


def nucleus_logp(logits_TV: torch.Tensor, tokens: list[int], temperature: float, top_p: float) -> list[float]:
    """Log-probs of `tokens` under temperature then top-p (the smallest top set holding `top_p` of the mass,
    renormalised), computed by hand."""
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
    if top_p < 1:
        sorted_TV, order_TV = logp_TV.exp().sort(dim=-1, descending=True)
        mass_before_TV = sorted_TV.cumsum(dim=-1) - sorted_TV
        keep_TV = torch.zeros_like(logp_TV, dtype=torch.bool).scatter(-1, order_TV, mass_before_TV < top_p)
        logp_TV = torch.log_softmax(logp_TV.masked_fill(~keep_TV, float("-inf")), dim=-1)
    return list(logp_TV.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist())


async def test_greedy_matches_hf_generate(
    engine: VLLMEngine, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    results = await asyncio.gather(*(engine.generate(f"g{i}", p, params) for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, 24)
        assert (result.finish_reason, result.prompt_tokens, result.versions) == ("length", len(prompt), [0] * 24)
    assert len({tuple(r.token_ids) for r in results}) > 1  # the test model does not just repeat itself


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (0.8, 0.6)])
async def test_logprobs_are_the_sampling_distributions(
    engine: VLLMEngine, reference: torch.nn.Module, prompts: list[list[int]], temperature: float, top_p: float
) -> None:
    params = SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=3)
    results = await asyncio.gather(*(engine.generate(f"l{i}", p, params) for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results, strict=True):
        logits_TV = teacher_forced_logits(reference, prompt, result.token_ids)
        # Greedy reports the plain softmax's log-probs, as HFEngine does.
        expected = nucleus_logp(logits_TV, result.token_ids, temperature or 1.0, top_p)
        assert result.logprobs == pytest.approx(expected, abs=1e-4)
    again = await engine.generate("again", prompts[2], params)
    assert again.token_ids == results[2].token_ids  # the seed fixes the sample


async def test_temperature_logprobs_of_the_trainer_match_vllm_sampling_at_0_7(
    engine: VLLMEngine, model_dir: Path, prompts: list[list[int]]
) -> None:
    """The importance ratio on tokens vLLM sampled at temperature 0.7 from the trainer's own weights: 1 when the
    trainer divides its logits by the temperature, as it does; far from 1 when it ignores it (the code before)."""
    ratios = await importance_ratios(engine, model_dir, prompts, temperature=0.7, trainer_temperature=0.7)
    assert abs(ratios.mean().item() - 1) <= 0.01 and ratios.max().item() < 1.1, (ratios.mean(), ratios.max())
    ignored = await importance_ratios(engine, model_dir, prompts, temperature=0.7, trainer_temperature=1.0)
    assert ignored.max().item() > 1.1, ignored.max()
    print(f"ratio at 0.7: mean {ratios.mean():.5f} max {ratios.max():.5f}; ignoring it: max {ignored.max():.3f}")


async def test_stop_tokens_end_a_request_and_are_included(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    free = await engine.generate("free", prompts[0], SamplingParams(max_tokens=24, temperature=0.0))
    stop_at = free.token_ids[5]
    stopped = await engine.generate(
        "stopped", prompts[0], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at])
    )
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"


async def test_sixteen_concurrent_requests_each_get_their_own_output(
    engine: VLLMEngine, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    requests = [prompts[i % len(PROMPTS)] + [10 + i] for i in range(16)]
    before = engine.load().generated_tokens
    started = time.monotonic()
    results = await asyncio.gather(
        *(engine.generate(f"c{i}", p, SamplingParams(max_tokens=32, temperature=0.0)) for i, p in enumerate(requests))
    )
    seconds = time.monotonic() - started
    print(f"\n16 concurrent x 32 tokens: {seconds:.3f} s, {16 * 32 / seconds:.0f} tokens/s")
    for prompt, result in zip(requests, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, 32)
        assert len(result.logprobs) == len(result.versions) == 32
    load = engine.load()
    assert (load.running, load.waiting, load.version) == (0, 0, 0)
    assert load.generated_tokens - before == 16 * 32
    assert 0 < load.busy_fraction <= 1


async def test_abort_ends_one_request_and_the_others_go_on(
    engine: VLLMEngine, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    greedy_long = SamplingParams(max_tokens=1000, temperature=0.0)
    before = engine.load().generated_tokens
    long = asyncio.create_task(engine.generate("long", prompts[1], greedy_long))
    await until(lambda: engine.load().generated_tokens > before + 20)
    others = [
        asyncio.create_task(engine.generate(f"o{i}", prompts[i], SamplingParams(max_tokens=64, temperature=0.0)))
        for i in range(3)
    ]
    assert await engine.abort("long")
    result = await long
    assert result.finish_reason == "abort"
    assert 20 < len(result.token_ids) < 1000
    assert len(result.logprobs) == len(result.versions) == len(result.token_ids)
    assert result.token_ids == hf_greedy(reference, prompts[1], len(result.token_ids))
    for other in await asyncio.gather(*others):
        assert (other.finish_reason, len(other.token_ids)) == ("length", 64)
    assert not await engine.abort("long")
    assert not await engine.abort("never-seen")


async def test_cancelling_the_caller_aborts(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    before = engine.load().generated_tokens
    long = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=1000, temperature=0)))
    await until(lambda: engine.load().generated_tokens > before)
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long
    assert engine.load().running == 0  # vLLM dropped it too
    after = await engine.generate("after", prompts[0], SamplingParams(max_tokens=4))
    assert len(after.token_ids) == 4


async def test_bad_requests_and_weights_are_refused(engine: VLLMEngine, reference: torch.nn.Module) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        await engine.generate("e", [], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await engine.generate("v", [5, 1000], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="exceeds"):
        await engine.generate("m", [5], SamplingParams(max_tokens=1024))
    weights = dict(reference.state_dict())
    weights.pop("model.norm.weight")
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(WeightsMismatch) as caught:
        await engine.load_weights(1, weights)
    assert "missing: model.norm.weight" in str(caught.value)
    assert "wrong shape: model.layers.0.mlp.up_proj.weight (2, 2) (model: (256, 128))" in str(caught.value)
    with pytest.raises(InvalidRequest, match="not newer"):
        await engine.load_weights(0, dict(reference.state_dict()))
    assert engine.version == 0


async def test_load_weights_swaps_under_a_request_in_flight(
    engine: VLLMEngine, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    before = await asyncio.gather(*(engine.generate(f"b{i}", p, greedy) for i, p in enumerate(prompts)))
    new_weights = noisy_weights(reference, seed=2, scale=0.1)  # no lm_head.weight: the engine adds the tied copy
    updated, _ = load_model_and_tokenizer(model_dir)
    updated.load_state_dict(new_weights, strict=False)  # tied: lm_head follows the embeddings

    produced = engine.load().generated_tokens
    running = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=1000, temperature=0)))
    await until(lambda: engine.load().generated_tokens > produced + 20)
    started = time.monotonic()
    await engine.load_weights(1, new_weights)
    print(f"\nload_weights under load: {1000 * (time.monotonic() - started):.0f} ms")
    # With the long request holding cache blocks vLLM cannot reset the prefix cache; the long prompt still must
    # not reuse blocks cached under the old weights.
    after = await asyncio.gather(*(engine.generate(f"a{i}", p, greedy) for i, p in enumerate(prompts)))
    produced = engine.load().generated_tokens
    await until(lambda: engine.load().generated_tokens > produced + 20)
    assert await engine.abort("long")
    long = await running

    assert long.finish_reason == "abort"  # it kept going through the swap
    swap = long.versions.index(1)
    assert 0 < swap < len(long.versions) and long.versions == [0] * swap + [1] * (len(long.versions) - swap)
    assert long.token_ids[:swap] == hf_greedy(reference, prompts[1], swap)
    for prompt, new in zip(prompts, after, strict=True):
        assert new.versions == [1] * 24
        assert new.token_ids == hf_greedy(updated, prompt, 24)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert engine.load().version == engine.version == 1


async def test_close_aborts_what_is_in_flight(engine: VLLMEngine, prompts: list[list[int]]) -> None:
    produced = engine.load().generated_tokens
    running = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=1000, temperature=0)))
    await until(lambda: engine.load().generated_tokens > produced)
    await engine.close()
    assert (await running).finish_reason == "abort"
    with pytest.raises(EngineClosed):
        await engine.generate("late", prompts[0], SamplingParams(max_tokens=4))
