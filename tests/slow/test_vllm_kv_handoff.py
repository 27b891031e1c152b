"""Disaggregated serving on real vLLM: one engine prefills a prompt and writes its KV cache to the KV store, another
reads it and decodes (`rollart.generation.vllm.kv_connector`), with greedy tokens equal to transformers' and log-probs
equal to one engine's whole request; a corrupted store changes the answer (so the KV read is the KV used), a missing one
does not (the engine prefills itself), and the decode half removes what it read, after reading it, however early or late
it is cut short.

Needs vLLM: `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_kv_handoff.py -p no:cacheprovider -q`.
The two engines share the module (each takes 20-50 s to start on a small CPU), one core each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollart.generation.engine import InvalidRequest, SamplingParams
from rollart.generation.kv_store import kv_key
from rollart.generation.vllm.engine import VLLMEngine
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import build_engine_test_model, hf_greedy
from tests.slow.vllm_marks import vllm_engine_marks

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(300)

torch.set_num_threads(1)

BLOCK = 128
"""vLLM's KV-cache block on CPU: only a prompt's whole blocks are handed on."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("vllm-kv") / "model")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def encode(model_dir: Path) -> object:
    _, tokenizer = load_model_and_tokenizer(model_dir)
    return tokenizer.encode


def long_prompt(encode: object, topic: str) -> list[int]:
    """Over two blocks (two of them handed on), different for each test so no engine has it in its prefix cache."""
    ids: list[int] = encode(f"A prompt about {topic}, long enough to fill whole KV-cache blocks. " * 6)  # type: ignore[operator]
    assert len(ids) > 2 * BLOCK + 1
    return ids


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_dir: Path, store: Path) -> AsyncIterator[tuple[VLLMEngine, VLLMEngine]]:
    # A small step budget: a prompt over 256 tokens is prefilled in chunks.
    prefill = VLLMEngine(model_dir, max_batch_size=8, cpu_threads_bind="0", kv_store=store, max_num_batched_tokens=256)
    decode = VLLMEngine(model_dir, max_batch_size=8, cpu_threads_bind="1", kv_store=store)
    await asyncio.gather(prefill.start(), decode.start())
    yield prefill, decode
    await asyncio.gather(prefill.close(), decode.close())


def greedy(max_tokens: int, **handoff: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **handoff)  # type: ignore[arg-type]


async def test_prefill_on_one_engine_decode_on_the_other(
    engines: tuple[VLLMEngine, VLLMEngine], model_dir: Path, store: Path, encode: object
) -> None:
    prefill, decode = engines
    prompt = long_prompt(encode, "handoff")
    half = await prefill.generate("t0/turn0/prefill", prompt, greedy(16, prefill_only=True))
    assert (half.token_ids, half.finish_reason, half.prompt_tokens) == ([], "length", len(prompt))
    written = store / kv_key("t0/turn0/prefill")
    assert len(list(written.glob("*.safetensors"))) == 4  # one file per layer of the tiny model

    cached_before = decode.load().kv_reused_tokens
    result = await decode.generate("t0/turn0", prompt, greedy(16, kv_from="prefill-gen/t0/turn0/prefill"))
    handed_on = (len(prompt) - 1) // BLOCK * BLOCK  # its whole blocks, short of the last token
    assert decode.load().kv_reused_tokens - cached_before == handed_on  # read, not computed: its prefix cache was cold
    reference, _ = load_model_and_tokenizer(model_dir)
    assert result.token_ids == hf_greedy(reference, prompt, 16)
    whole = await prefill.generate("t0/whole", prompt, greedy(16))
    assert result.token_ids == whole.token_ids
    assert result.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert not written.exists()  # the decode half removed what it read


async def test_the_kv_read_is_the_kv_used(engines: tuple[VLLMEngine, VLLMEngine], encode: object, store: Path) -> None:
    """Zeroed KV in the store changes the decode half's answer: the engine used what it read, computing only the
    prompt's last tokens itself."""
    prefill, decode = engines
    prompt = long_prompt(encode, "corruption")
    whole = await prefill.generate("t1/whole", prompt, greedy(8))
    await prefill.generate("t1/turn0/prefill", prompt, greedy(8, prefill_only=True))
    from safetensors.torch import load_file, save_file

    for layer in (store / kv_key("t1/turn0/prefill")).glob("*.safetensors"):
        kv = load_file(layer)["kv_cache"]
        save_file({"kv_cache": torch.zeros_like(kv)}, layer)
    result = await decode.generate("t1/turn0", prompt, greedy(8, kv_from="p/t1/turn0/prefill"))
    assert result.logprobs != pytest.approx(whole.logprobs, abs=1e-3)


async def test_a_missing_handoff_is_prefilled_by_the_decoder(
    engines: tuple[VLLMEngine, VLLMEngine], encode: object
) -> None:
    prefill, decode = engines
    prompt = long_prompt(encode, "loss")
    cached_before = decode.load().kv_reused_tokens
    result = await decode.generate("t2/turn0", prompt, greedy(8, kv_from="p/never/prefilled"))
    whole = await prefill.generate("t2/whole", prompt, greedy(8))
    assert decode.load().kv_reused_tokens == cached_before
    assert result.token_ids == whole.token_ids
    assert result.logprobs == pytest.approx(whole.logprobs, abs=1e-4)


async def test_one_request_is_not_both_halves(engines: tuple[VLLMEngine, VLLMEngine], encode: object) -> None:
    prefill, _ = engines
    with pytest.raises(InvalidRequest, match="either the prefill half"):
        await prefill.generate("t4", long_prompt(encode, "both"), greedy(8, prefill_only=True, kv_from="p/x"))


async def test_decode_halves_cut_short_at_any_moment_leave_nothing_and_the_engine_serving(
    engines: tuple[VLLMEngine, VLLMEngine], encode: object, store: Path
) -> None:
    """Decode halves cancelled from before their read to mid-decode (redundant rollouts' extras are): the reading
    engine removes each folder after its read, or unread when the request ends, never during a read, which killed
    the engine (a removal from outside vLLM raced the worker's read)."""
    prefill, decode = engines
    prompts = [long_prompt(encode, f"cut short {i}") for i in range(12)]
    for i, prompt in enumerate(prompts):
        await prefill.generate(f"t5/{i}/prefill", prompt, greedy(1, prefill_only=True))

    async def cut(i: int, after_s: float) -> None:
        call = asyncio.create_task(decode.generate(f"t5/{i}", prompts[i], greedy(48, kv_from=f"p/t5/{i}/prefill")))
        await asyncio.sleep(after_s)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call

    await asyncio.gather(*(cut(i, 0.01 + 0.003 * i * i) for i in range(len(prompts))))  # 10 ms to 0.37 s
    after = await decode.generate("t5/after", prompts[0], greedy(4))
    assert len(after.token_ids) == 4  # the engine serves on
    assert os.listdir(store) == []
