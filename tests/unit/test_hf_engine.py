"""HFEngine on the tiny model: batching, greedy and log-prob exactness, abort, weight swaps, seeds, load, close."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from rollart.generation.engine import EngineClosed, GenerationResult, InvalidRequest, SamplingParams, WeightsMismatch
from rollart.generation.hf.engine import HFEngine
from rollart.models.loading import load_model_and_tokenizer
from tests.engine_reference import EOS, build_engine_test_model, encoded_prompts, hf_greedy, noisy_weights

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_engine_test_model(tmp_path_factory.mktemp("hf-engine") / "model")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> torch.nn.Module:
    """The same model outside the engine, for HF's own generate and teacher-forced log-probs."""
    model, _ = load_model_and_tokenizer(model_dir)
    return model


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return encoded_prompts(model_dir)


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HFEngine]:
    engine = HFEngine(model_dir, max_batch_size=64)
    await engine.start()
    yield engine
    await engine.close()


def teacher_forced_logp(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float
) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    return list(logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist())


async def until(condition: object, timeout_s: float = 30.0) -> None:
    """Yield to the event loop until `condition()` holds, for up to `timeout_s` (the engine's thread may be
    slow to get there on a loaded machine: a bound in yields alone failed once in a full unit run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def check_shape(result: GenerationResult, max_tokens: int, version: int = 0) -> None:
    n = len(result.token_ids)
    assert len(result.logprobs) == n and result.versions == [version] * n
    if result.finish_reason == "length":
        assert n == max_tokens
    else:
        assert result.finish_reason == "stop" and 1 <= n <= max_tokens and result.token_ids[-1] == EOS


async def test_sixteen_concurrent_requests_share_one_batch(engine: HFEngine, prompts: list[list[int]]) -> None:
    requests = [(prompts[i % len(prompts)] + [10 + i], 4 + i) for i in range(16)]
    results = await asyncio.gather(
        *(
            engine.generate(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0))
            for i, (prompt, max_tokens) in enumerate(requests)
        )
    )
    assert engine.batches_run == 1
    for (prompt, max_tokens), result in zip(requests, results, strict=True):
        check_shape(result, max_tokens)
        assert result.prompt_tokens == len(prompt)
    load = engine.load()
    assert load.running == 0 and load.waiting == 0 and load.version == 0
    assert load.generated_tokens == sum(len(r.token_ids) for r in results)
    assert 0 < load.busy_fraction <= 1


async def test_greedy_matches_hf_generate(
    engine: HFEngine, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    results = await asyncio.gather(*(engine.generate(f"g{i}", p, params) for i, p in enumerate(prompts)))
    assert engine.batches_run == 1  # left-padded together
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(reference, prompt, 24)
        check_shape(result, 24)
    assert len({tuple(r.token_ids) for r in results}) > 1  # the test model does not just repeat itself


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
async def test_logprobs_match_teacher_forcing(
    engine: HFEngine, reference: torch.nn.Module, prompts: list[list[int]], temperature: float
) -> None:
    params = SamplingParams(max_tokens=16, temperature=temperature)
    results = await asyncio.gather(*(engine.generate(f"l{i}", p, params) for i, p in enumerate(prompts)))
    for prompt, result in zip(prompts, results, strict=True):
        expected = teacher_forced_logp(reference, prompt, result.token_ids, temperature)
        assert result.logprobs == pytest.approx(expected, abs=1e-4)


async def test_top_p_samples_inside_the_nucleus(
    engine: HFEngine, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.5)
    result = await engine.generate("p", prompts[0], params)
    unrenormalised = teacher_forced_logp(reference, prompts[0], result.token_ids, 0.8)
    # Renormalised over the nucleus (mass >= 0.5): each log-prob is higher, by at most log 2.
    for got, full in zip(result.logprobs, unrenormalised, strict=True):
        assert full - 1e-4 <= got <= full + 0.6931472 + 1e-4


async def test_stop_tokens_end_a_row_and_are_included(engine: HFEngine, prompts: list[list[int]]) -> None:
    free = await engine.generate("free", prompts[0], SamplingParams(max_tokens=24, temperature=0.0))
    stop_at = free.token_ids[5]
    stopped = await engine.generate(
        "stopped", prompts[0], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at])
    )
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


async def test_eos_always_stops(engine: HFEngine, reference: torch.nn.Module, prompts: list[list[int]]) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = (await engine.generate("free", prompts[0], greedy)).token_ids[0]
    with torch.inference_mode():
        assert reference(torch.tensor([prompts[0]])).logits[0, -1, first] > 0
    # EOS's (tied) embedding at twice the greedy token's: EOS's logit is then twice the largest one.
    weights = {name: tensor.clone() for name, tensor in reference.state_dict().items() if name != "lm_head.weight"}
    weights["model.embed_tokens.weight"][EOS] = 2 * weights["model.embed_tokens.weight"][first]
    await engine.load_weights(1, weights)
    result = await engine.generate("eos", prompts[0], greedy)
    assert (result.token_ids, result.finish_reason, result.versions) == ([EOS], "stop", [1])


async def test_seeded_sampling_is_reproducible(engine: HFEngine, prompts: list[list[int]]) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=20, temperature=1.0, seed=seed)

    noise = [engine.generate(f"n{i}", p, SamplingParams(max_tokens=20)) for i, p in enumerate(prompts)]
    a, b, c, *_ = await asyncio.gather(
        engine.generate("a", prompts[2], params(7)),
        engine.generate("b", prompts[2], params(7)),
        engine.generate("c", prompts[2], params(8)),
        *noise,
    )
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids
    again = await engine.generate("a", prompts[2], params(7))
    assert again.token_ids == a.token_ids


async def test_abort_of_a_queued_and_a_running_request(engine: HFEngine, prompts: list[list[int]]) -> None:
    running = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=1000, temperature=0)))
    await until(lambda: engine.load().running == 1)
    queued = asyncio.create_task(engine.generate("queued", prompts[0], SamplingParams(max_tokens=8)))
    await until(lambda: engine.load().waiting == 1)

    assert await engine.abort("queued")
    result = await queued
    assert (result.finish_reason, result.token_ids, result.prompt_tokens) == ("abort", [], 0)
    assert engine.load().running == 1  # the batch is still going

    assert await engine.abort("long")
    result = await running
    assert result.finish_reason == "abort"
    assert len(result.token_ids) < 1000
    assert len(result.logprobs) == len(result.versions) == len(result.token_ids)
    assert not await engine.abort("long")
    assert not await engine.abort("never-seen")


async def test_cancelling_the_caller_aborts(engine: HFEngine, prompts: list[list[int]]) -> None:
    running = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=1000, temperature=0)))
    await until(lambda: engine.load().running == 1)
    queued = asyncio.create_task(engine.generate("queued", prompts[0], SamplingParams(max_tokens=8)))
    await until(lambda: engine.load().waiting == 1)
    queued.cancel()
    running.cancel()
    await asyncio.gather(queued, running, return_exceptions=True)
    assert engine.load().waiting == 0
    await until(lambda: engine.load().running == 0)  # the batch stopped early: every row was aborted
    after = await engine.generate("after", prompts[0], SamplingParams(max_tokens=4))
    assert len(after.token_ids) <= 4


def with_weights(model_dir: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model, _ = load_model_and_tokenizer(model_dir)
    model.load_state_dict(weights, strict=False)  # lm_head is tied: it follows the embeddings
    return model


class DecodeGate:
    """Holds the engine's worker thread after the given forward passes of its model (the first of a `generate` is
    the prefill, each later one a decode step), until the test lets it go: a test acts between two decode steps
    without sleeping. The token of a held pass is sampled after the release."""

    def __init__(self, engine: HFEngine, at: set[int]) -> None:
        assert engine._model is not None
        self.loop = asyncio.get_running_loop()
        self.at, self.calls = at, 0
        self.reached: asyncio.Queue[int] = asyncio.Queue()
        self.go = threading.Semaphore(0)
        self.hook = engine._model.register_forward_hook(self._on_forward)

    def _on_forward(self, *_: object) -> None:
        self.calls += 1
        if self.calls in self.at:
            self.loop.call_soon_threadsafe(self.reached.put_nowait, self.calls)
            self.go.acquire(timeout=30)

    async def held(self) -> int:
        return await asyncio.wait_for(self.reached.get(), 30)

    def release(self) -> None:
        self.go.release()


async def test_load_weights_swaps_between_decode_steps_of_a_running_request(
    engine: HFEngine, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    before = await engine.generate("before", prompts[0], greedy)
    new_weights = noisy_weights(reference, seed=2, scale=0.1)
    updated = with_weights(model_dir, new_weights)

    gate = DecodeGate(engine, at={10})
    running = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=64, temperature=0)))
    await gate.held()
    await engine.load_weights(1, new_weights)
    after = asyncio.create_task(engine.generate("after", prompts[0], greedy))  # joins the continued batch
    gate.release()
    long, after_result = await running, await after

    # 10 tokens under version 0, then the swap at the next decode step and the rest under version 1.
    assert long.versions == [0] * 10 + [1] * 54 and long.finish_reason == "length"
    assert long.prompt_tokens == len(prompts[1])
    prefix = prompts[1] + long.token_ids[:10]
    assert long.token_ids[:10] == hf_greedy(reference, prompts[1], 10)
    assert long.token_ids[10:] == hf_greedy(updated, prefix, 54) != hf_greedy(reference, prefix, 54)
    assert long.logprobs[:10] == pytest.approx(
        teacher_forced_logp(reference, prompts[1], long.token_ids[:10], 0), abs=1e-4
    )
    assert long.logprobs[10:] == pytest.approx(teacher_forced_logp(updated, prefix, long.token_ids[10:], 0), abs=1e-4)
    assert after_result.versions == [1] * 24
    assert after_result.token_ids == hf_greedy(updated, prompts[0], 24) != before.token_ids
    assert engine.load().version == engine.version == 1
    assert engine.batches_run == 3  # before; long until the swap; long's continuation with after


async def test_swaps_in_one_sampled_request_version_its_tokens_in_order(
    engine: HFEngine, model_dir: Path, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    weights = {v: noisy_weights(reference, seed=10 + v, scale=0.1) for v in (1, 2, 3)}
    for version_weights in weights.values():
        version_weights["model.embed_tokens.weight"][EOS] = 0.0  # as in the test model: EOS is rarely sampled
    gate = DecodeGate(engine, at={5, 12})  # the continuation's prefill is pass 6
    # Seed 5 samples no EOS before max_tokens with these weights (seeded sampling is deterministic on CPU).
    running = asyncio.create_task(engine.generate("s", prompts[2], SamplingParams(max_tokens=64, seed=5)))
    await gate.held()
    await engine.load_weights(1, weights[1])
    gate.release()
    await gate.held()
    await engine.load_weights(2, weights[2])
    await engine.load_weights(3, weights[3])  # staged over 2 before 2 was applied: 2 never runs
    gate.release()
    result = await running

    assert result.versions == [0] * 5 + [1] * 7 + [3] * 52
    # Each piece's log-probs are under the weights that sampled it (temperature 1: the plain softmax).
    expected, prompt = [], prompts[2]
    for model, start, stop in ((reference, 0, 5), (with_weights(model_dir, weights[1]), 5, 12)):
        expected += teacher_forced_logp(model, prompt + result.token_ids[:start], result.token_ids[start:stop], 1.0)
    rest = result.token_ids[12:]
    expected += teacher_forced_logp(with_weights(model_dir, weights[3]), prompt + result.token_ids[:12], rest, 1.0)
    assert result.logprobs == pytest.approx(expected, abs=1e-4)


async def test_abort_of_a_continued_request(
    engine: HFEngine, reference: torch.nn.Module, prompts: list[list[int]]
) -> None:
    greedy = SamplingParams(max_tokens=64, temperature=0)
    gate = DecodeGate(engine, at={5})
    queued = asyncio.create_task(engine.generate("queued", prompts[1], greedy))
    await gate.held()
    await engine.load_weights(1, noisy_weights(reference, seed=2, scale=0.1))
    gate.release()
    await until(lambda: engine.load().waiting == 1)  # cut, and queued again while the weights are copied
    assert await engine.abort("queued")
    result = await queued
    assert (result.versions, result.finish_reason, result.prompt_tokens) == ([0] * 5, "abort", len(prompts[1]))
    assert len(result.token_ids) == len(result.logprobs) == 5
    gate.hook.remove()

    gate = DecodeGate(engine, at={5, 7})  # the continuation's prefill is pass 6
    running = asyncio.create_task(engine.generate("running", prompts[1], greedy))
    await gate.held()
    await engine.load_weights(2, noisy_weights(reference, seed=3, scale=0.1))
    gate.release()
    await gate.held()
    assert engine.load().running == 1
    assert await engine.abort("running")
    gate.release()
    result = await running
    assert (result.versions, result.finish_reason) == ([1] * 5 + [2] * 2, "abort")
    assert len(result.token_ids) == len(result.logprobs) == 7


async def test_bad_weights_are_refused_with_the_names(engine: HFEngine, reference: torch.nn.Module) -> None:
    weights = dict(reference.state_dict())
    weights.pop("model.norm.weight")
    weights["model.layers.9.mlp.up_proj.weight"] = torch.zeros(3)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(WeightsMismatch) as caught:
        await engine.load_weights(1, weights)
    message = str(caught.value)
    assert "missing: model.norm.weight" in message
    assert "unexpected: model.layers.9.mlp.up_proj.weight" in message
    assert "wrong shape: model.layers.0.mlp.up_proj.weight (2, 2) (model: (256, 128))" in message

    untied = dict(reference.state_dict())
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    with pytest.raises(WeightsMismatch, match=r"lm_head\.weight is tied to model\.embed_tokens\.weight"):
        await engine.load_weights(1, untied)
    with pytest.raises(InvalidRequest, match="not newer"):
        await engine.load_weights(0, dict(reference.state_dict()))
    assert engine.version == 0


async def test_bad_requests_are_refused(engine: HFEngine) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        await engine.generate("e", [], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        await engine.generate("v", [5, 1000], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest, match="exceeds"):
        await engine.generate("m", [5], SamplingParams(max_tokens=1024))
    for half in (SamplingParams(max_tokens=4, prefill_only=True), SamplingParams(max_tokens=4, kv_from="g/r")):
        with pytest.raises(InvalidRequest, match=r"does not hand KV cache .* with generator.kv_store set"):
            await engine.generate("d", [5], half)


async def test_close_aborts_what_is_pending(model_dir: Path, prompts: list[list[int]]) -> None:
    engine = HFEngine(model_dir)
    await engine.start()
    running = asyncio.create_task(engine.generate("long", prompts[1], SamplingParams(max_tokens=1000, temperature=0)))
    await until(lambda: engine.load().running == 1)
    queued = asyncio.create_task(engine.generate("queued", prompts[0], SamplingParams(max_tokens=8)))
    await until(lambda: engine.load().waiting == 1)
    await engine.close()
    assert (await running).finish_reason == "abort"
    assert (await queued).finish_reason == "abort"
    with pytest.raises(EngineClosed):
        await engine.generate("late", prompts[0], SamplingParams(max_tokens=4))
