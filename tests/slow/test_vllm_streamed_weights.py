"""Weights streamed into a running vLLM engine, with real vLLM: a push through `WeightPublisher` ->
`WeightReceiver(engine.load_weights)` creates no file (inotify on TMPDIR, /dev/shm and the run folder), and an
engine given trained weights by streaming (bf16 on the wire, lm_head left out) generates exactly what an engine
started from the same weights saved as a model folder generates.

Needs vLLM: `bin/setup-vllm`, then `.venv-vllm/bin/python -m pytest tests/slow/test_vllm_streamed_weights.py`.
One engine serves the module, started with TMPDIR pointing at a folder of the module's own (its processes inherit
it), so the watch sees what vLLM's processes would put in the temp dir. The tests run in file order.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rollart.generation.engine import GenerationResult, SamplingParams
from rollart.generation.vllm.engine import VLLMEngine
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import (
    PROMPTS,
    build_engine_test_model,
    generate_all,
    hf_greedy,
    noisy_weights,
    with_weights,
)
from tests.filewatch import SHM, FileWatch, private_tmpdir
from tests.slow.vllm_marks import vllm_engine_marks
from tests.weight_push import push_over_tcp

pytest.importorskip("vllm", reason="vLLM is not installed: run bin/setup-vllm and use .venv-vllm")

pytestmark = vllm_engine_marks(300)

torch.set_num_threads(1)  # the engine's processes need the cores

LONG_PROMPT = "A long prompt, so that whole blocks of it land in the prefix cache. " * 5
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("streamed")


@pytest.fixture(scope="module")
def private_tmp(folder: Path) -> Iterator[Path]:
    with private_tmpdir(folder / "tmp") as tmp:
        yield tmp


@pytest.fixture(scope="module")
def model_dir(folder: Path) -> Path:
    return build_engine_test_model(folder / "run" / "model")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    _, tokenizer = load_model_and_tokenizer(model_dir)
    return [tokenizer.encode(text) for text in [*PROMPTS, LONG_PROMPT]]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path, private_tmp: Path) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(model_dir, max_batch_size=16)
    await engine.start()
    yield engine
    await engine.close()


async def greedy(engine: VLLMEngine, prompts: list[list[int]], tag: str) -> list[GenerationResult]:
    return await generate_all(engine, prompts, tag, GREEDY)


async def test_no_file_during_push_into_the_vllm_engine(
    engine: VLLMEngine, folder: Path, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    new_weights = noisy_weights(reference, seed=2, scale=0.1)  # no lm_head.weight: tied to the embeddings
    started = time.monotonic()
    with FileWatch([folder / "tmp", SHM, folder / "run"]) as watch:  # TMPDIR: the engine's private_tmp
        stats = await push_over_tcp(engine.load_weights, 1, new_weights)
    print(f"\npush into vLLM (publish to applied): {1000 * (time.monotonic() - started):.0f} ms")
    assert watch.touched() == []
    assert stats.version == engine.version == 1

    updated = with_weights(model_dir, new_weights)
    for prompt, result in zip(prompts, await greedy(engine, prompts, "p"), strict=True):
        assert result.versions == [1] * 24
        assert result.token_ids == hf_greedy(updated, prompt, 24)


async def test_streamed_load_matches_an_engine_started_from_the_weights_on_disk(
    engine: VLLMEngine, folder: Path, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    # A trained copy as the wire will carry it: in the generator's dtype (bf16 here, into an fp32 engine: vLLM's
    # loader converts), without the tied lm_head.
    trained = {name: t.to(torch.bfloat16) for name, t in noisy_weights(reference, seed=3, scale=0.1).items()}
    started = time.monotonic()
    await engine.load_weights(2, trained)
    print(f"\nload_weights (bf16 in, fp32 engine): {1000 * (time.monotonic() - started):.0f} ms")
    streamed = await greedy(engine, prompts, "s")
    await engine.close()  # one engine at a time on this machine; the fixture's close is then a no-op

    on_disk = folder / "trained"
    shutil.copytree(model_dir, on_disk)
    trained_fp32 = {name: t.float() for name, t in trained.items()}  # bf16 -> fp32 is exact
    trained_model = with_weights(model_dir, trained_fp32)
    trained_model.save_pretrained(on_disk)
    from_disk = VLLMEngine(on_disk, max_batch_size=16)
    await from_disk.start()
    try:
        loaded = await greedy(from_disk, prompts, "d")
    finally:
        await from_disk.close()

    for prompt, s, d in zip(prompts, streamed, loaded, strict=True):
        assert s.token_ids == d.token_ids == hf_greedy(trained_model, prompt, 24)
        assert s.logprobs == pytest.approx(d.logprobs, abs=1e-6)
        assert (s.versions, d.versions) == ([2] * 24, [0] * 24)
    assert [s.token_ids for s in streamed] != [hf_greedy(reference, p, 24) for p in prompts]
