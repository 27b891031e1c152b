"""The simulated engine follows its hardware model: prefill scales with FLOPs, decode with
bandwidth, requests queue when the KV cache is full. Event-loop time is virtual (looptime), so
simulated seconds pass instantly and exactly."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from rollart.clock import SimClock, virtual_event_loop
from rollart.errors import ConfigError
from rollart.generation.engine import GenerationResult, InvalidRequest, SamplingParams
from rollart.generation.sim import PREFIX_BLOCK, SimEngine, _block_hashes
from rollart.sim.hardware import GPUS, MODELS, CostModel, EngineShape, train_step_s, transfer_s

TOKENS = list(range(10, 20))


def virtual(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on the virtual-time loop."""

    @functools.wraps(test)
    def run() -> None:
        with asyncio.Runner(loop_factory=virtual_event_loop) as runner:
            runner.run(test())

    return run


def engine(gpu: str = "H800", gpus: int = 1, model: str = "qwen3-8b", **kwargs: object) -> SimEngine:
    cost = CostModel.build(EngineShape(gpu=gpu, gpus=gpus), model)
    return SimEngine(cost, clock=SimClock(), token_ids=TOKENS, eos_id=2, **kwargs)  # type: ignore[arg-type]


async def timed(eng: SimEngine, prompt: int, max_tokens: int, n: int = 1) -> tuple[float, list[GenerationResult]]:
    """Seconds (simulated) until `n` identical requests submitted together are all answered."""
    await eng.start()
    clock = eng.clock
    start = clock.now()
    params = SamplingParams(max_tokens=max_tokens)
    results = await asyncio.gather(*(eng.generate(f"r{i}", [1] * prompt, params) for i in range(n)))
    took = clock.now() - start
    await eng.close()
    return took, results


def test_cost_model_by_hand() -> None:
    cost = CostModel.build(EngineShape(gpu="H20", gpus=2, mfu=0.5, mbu=0.7), "qwen3-32b")
    flops = 2 * 148e12 * 0.5
    assert cost.prefill_s(1000) == pytest.approx(2 * 32.8e9 * 1000 / flops)
    weights, kv = 32.8e9 * 2, 2 * 64 * 8 * 128 * 2
    assert cost.model.kv_bytes_per_token == kv == 262144
    assert cost.decode_step_s(4, 10_000) == pytest.approx((weights + kv * 10_000) / (2 * 4e12 * 0.7))
    assert cost.kv_capacity_tokens == int((2 * 96e9 * 0.9 - weights) // kv)
    assert cost.cost_per_hour == 2.0
    # a big enough batch turns decode compute-bound
    assert cost.decode_step_s(100_000, 0) == pytest.approx(2 * 32.8e9 * 100_000 / flops)


def test_a_mixture_of_experts_computes_with_its_active_parameters_and_reads_all_of_them() -> None:
    moe = CostModel.build(EngineShape(gpu="H20", gpus=2, mfu=0.5, mbu=0.7), "qwen3-30b-a3b")
    flops, weights = 2 * 148e12 * 0.5, 30.5e9 * 2
    assert moe.prefill_s(1000) == pytest.approx(2 * 3.3e9 * 1000 / flops)
    assert moe.decode_step_s(4, 0) == pytest.approx(weights / (2 * 4e12 * 0.7))
    # a batch of 128 leaves it bandwidth-bound, where a dense model of its size is compute-bound from about 20
    dense = CostModel.build(EngineShape(gpu="H20", gpus=2, mfu=0.5, mbu=0.7), "qwen3-32b")
    assert moe.decode_step_s(128, 0) == pytest.approx(weights / (2 * 4e12 * 0.7))
    assert dense.decode_step_s(128, 0) == pytest.approx(2 * 32.8e9 * 128 / flops)
    assert train_step_s(MODELS["qwen3-30b-a3b"], GPUS["H800"], gpus=1, mfu=1.0, tokens=1) == pytest.approx(
        6 * 3.3e9 / 989.5e12
    )


def test_a_model_that_does_not_fit_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"does not fit on 1 x H800 at mem_fraction 0\.8"):
        CostModel.build(EngineShape(gpu="H800", gpus=1, mem_fraction=0.8), "qwen3-32b")  # 65.6 GB of weights
    with pytest.raises(ConfigError, match="unknown GPU 'A100'"):
        CostModel.build(EngineShape(gpu="A100"), "qwen3-8b")


@virtual
async def test_prefill_time_follows_flops() -> None:
    h800, _ = await timed(engine("H800"), prompt=8000, max_tokens=1)
    h20, _ = await timed(engine("H20"), prompt=8000, max_tokens=1)
    # one token of decode beside 8000 of prefill: the ratio is the TFLOPS ratio, to within the decode step
    assert h20 / h800 == pytest.approx(GPUS["H800"].tflops / GPUS["H20"].tflops, rel=0.05)
    assert h800 == pytest.approx(2 * MODELS["qwen3-8b"].params_b * 1e9 * 8000 / (989.5e12 * 0.5), rel=0.05)


@virtual
async def test_decode_time_follows_bandwidth_and_batches_nearly_free() -> None:
    h800, _ = await timed(engine("H800"), prompt=1, max_tokens=500)
    h20, _ = await timed(engine("H20"), prompt=1, max_tokens=500)
    assert h800 / h20 == pytest.approx(GPUS["H20"].hbm_tb_s / GPUS["H800"].hbm_tb_s, rel=0.02)
    one, _ = await timed(engine("H20"), prompt=1, max_tokens=500, n=1)
    eight, results = await timed(engine("H20"), prompt=1, max_tokens=500, n=8)
    assert all(len(r.token_ids) == 500 and r.finish_reason == "length" for r in results)
    assert eight < 1.1 * one  # the weight read dominates: 8 requests cost about what one does (an H20 turns
    # compute-bound near 30)


@virtual
async def test_requests_queue_when_the_kv_cache_is_full() -> None:
    eng = engine("H800", model="qwen3-8b")
    capacity = eng.cost.kv_capacity_tokens
    per_request = capacity // 3 + 1  # two fit at once, a third must wait
    prompt = per_request - 100
    both, _ = await timed(engine("H800"), prompt=prompt, max_tokens=100, n=2)
    three, _ = await timed(engine("H800"), prompt=prompt, max_tokens=100, n=3)
    assert three > 1.4 * both
    with pytest.raises(InvalidRequest, match=r"needs \d+ tokens of KV cache"):
        await timed(engine("H800"), prompt=capacity, max_tokens=10)


@virtual
async def test_tokens_logprobs_versions_and_abort() -> None:
    eng = engine("H20", length_min_frac=0.5)
    await eng.start()
    result = await eng.generate("a", [1, 2, 3], SamplingParams(max_tokens=40, seed=7))
    again = await eng.generate("b", [1, 2, 3], SamplingParams(max_tokens=40, seed=7))
    assert result.token_ids == again.token_ids and 20 <= len(result.token_ids) <= 40
    assert set(result.token_ids[:-1]) <= set(TOKENS)
    assert result.logprobs == [pytest.approx(-math.log(len(TOKENS)))] * len(result.token_ids)
    assert result.prompt_tokens == 3 and set(result.versions) == {0}
    long = asyncio.ensure_future(eng.generate("c", [1], SamplingParams(max_tokens=100_000)))
    await eng.clock.sleep(1.0)
    await eng.load_weights(3, {})
    await eng.clock.sleep(1.0)
    assert await eng.abort("c")
    cut = await long
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < 100_000 and set(cut.versions) == {0, 3}
    assert not await eng.abort("c")
    load = eng.load()
    assert load.running == load.waiting == 0 and 0.9 < load.busy_fraction <= 1.0
    await eng.close()


@virtual
async def test_replicas_share_the_queue_and_multiply_throughput() -> None:
    one, _ = await timed(engine("H20", max_batch_size=16), prompt=100, max_tokens=200, n=64)
    four, results = await timed(engine("H20", max_batch_size=16, replicas=4), prompt=100, max_tokens=200, n=64)
    assert all(len(r.token_ids) == 200 for r in results)
    assert four == pytest.approx(one / 4, rel=0.1)  # 4 batches of 16 at once instead of one after another


def test_training_and_transfer_times_by_hand() -> None:
    model, h800 = MODELS["qwen3-32b"], GPUS["H800"]
    assert train_step_s(model, h800, gpus=32, mfu=0.4, tokens=1_000_000) == pytest.approx(
        6 * 32.8e9 * 1e6 / (32 * 989.5e12 * 0.4)
    )
    assert transfer_s(model, gbps=200) == pytest.approx(65.6e9 * 8 / 200e9)


@virtual
async def test_requests_aborted_during_their_prefill_leave_the_engine_running() -> None:
    eng = engine("H20")
    await eng.start()
    params = SamplingParams(max_tokens=10)
    doomed = [asyncio.ensure_future(eng.generate(f"d{i}", [1] * 50_000, params)) for i in range(4)]
    await eng.clock.sleep(0.001)  # they are being prefilled now
    for i in range(4):
        assert await eng.abort(f"d{i}")
    assert [r.finish_reason for r in await asyncio.gather(*doomed)] == ["abort"] * 4
    later = await eng.generate("later", [1] * 10, params)
    assert later.finish_reason == "length" and len(later.token_ids) == 10
    await eng.close()


@virtual
async def test_a_pause_for_loading_weights_delays_generation_by_its_length() -> None:
    plain, _ = await timed(engine(), prompt=100, max_tokens=50)
    eng = engine()
    await eng.start()
    start = eng.clock.now()
    eng.pause(7.0)  # loading weights: nothing is generated meanwhile
    result = await eng.generate("r", [1] * 100, SamplingParams(max_tokens=50))
    assert eng.clock.now() - start == pytest.approx(plain + 7.0, rel=1e-4)
    await eng.close()
    assert len(result.token_ids) == 50


@virtual
async def test_disaggregated_halves_prefill_on_one_engine_and_decode_on_another() -> None:
    """A prefill_only request costs the prefill, sends the prompt's KV cache on its link (tokens x KV bytes
    per token at kv_link_gbps) and ends with no tokens; the decode half receives it on its own link, then
    decodes with no prefill, exactly as long as a whole request decodes."""
    prompt, decoded = 20_000, 64
    prefill, decode = engine("H800", model="qwen3-32b", gpus=8), engine("H20", model="qwen3-32b", gpus=8)
    await prefill.start()
    await decode.start()
    start = prefill.clock.now()
    first = await prefill.generate("t/prefill", [1] * prompt, SamplingParams(max_tokens=decoded, prefill_only=True))
    assert first.token_ids == [] and first.finish_reason == "length" and first.prompt_tokens == prompt
    link_s = prompt * MODELS["qwen3-32b"].kv_bytes_per_token * 8 / 200e9
    assert prefill.clock.now() - start == pytest.approx(prefill.cost.prefill_s(prompt) + link_s, abs=1e-5)
    assert prefill.generated_tokens == 0 and prefill.prefilled_tokens == prompt
    handed = prefill.clock.now()
    second = await decode.generate("t", [1] * prompt, SamplingParams(max_tokens=decoded, kv_from="gen-compute/t"))
    decode_s = sum(decode.cost.decode_step_s(1, prompt + i) for i in range(decoded))
    assert decode.clock.now() - handed == pytest.approx(link_s + decode_s, abs=1e-4)
    assert len(second.token_ids) == decoded and second.prompt_tokens == prompt
    assert decode.prefilled_tokens == 0 and decode.prefill_s == 0 and decode.kv_received_tokens == prompt
    with pytest.raises(InvalidRequest, match="either the prefill half"):
        await decode.generate("x", [1], SamplingParams(max_tokens=1, prefill_only=True, kv_from="g/x"))
    await prefill.close()
    await decode.close()


@virtual
async def test_with_the_prefix_cache_a_trajectorys_next_turn_sends_only_its_new_tokens() -> None:
    """Prefilled on one engine and decoded on another, each keeping the trajectory's history: the first turn's
    KV cache crosses whole; the second turn's only for what each end lacks (the prefill engine prefilled and
    sends what follows the first prompt's whole blocks; the decoding engine, holding the first prompt and its
    reply, receives what follows those)."""
    prefill = engine("H800", model="qwen3-32b", gpus=8, prefix_cache=True)
    decode = engine("H20", model="qwen3-32b", gpus=8, prefix_cache=True)
    await prefill.start()
    await decode.start()
    half = SamplingParams(max_tokens=40, prefill_only=True)
    rest = SamplingParams(max_tokens=40, kv_from="gen-compute/t")
    first = list(range(3, 3 + 1000))
    await prefill.generate("t/0/prefill", first, half)
    reply = await decode.generate("t/0", first, rest)
    assert decode.kv_received_tokens == len(first)
    second = first + reply.token_ids + list(range(2000, 2500))
    link_s = MODELS["qwen3-32b"].kv_bytes_per_token * 8 / 200e9  # a token's
    sent = len(second) - len(first) // PREFIX_BLOCK * PREFIX_BLOCK
    start = prefill.clock.now()
    await prefill.generate("t/1/prefill", second, half)
    assert prefill.prefilled_tokens == len(first) + sent
    assert prefill.clock.now() - start == pytest.approx(prefill.cost.prefill_s(sent) + sent * link_s, abs=1e-5)
    received = len(second) - (len(first) + len(reply.token_ids)) // PREFIX_BLOCK * PREFIX_BLOCK
    start = decode.clock.now()
    await decode.generate("t/1", second, rest)
    assert decode.kv_received_tokens == len(first) + received
    decode_s = sum(decode.cost.decode_step_s(1, len(second) + i) for i in range(40))
    assert decode.clock.now() - start == pytest.approx(received * link_s + decode_s, abs=1e-4)
    assert decode.prefilled_tokens == 0
    await prefill.close()
    await decode.close()


@virtual
async def test_kv_transfers_share_the_replicas_links() -> None:
    """Two decode halves arriving together on one replica's link: the second waits for the first's transfer;
    with two replicas (two links) they arrive together."""
    prompt = 50_000
    params = SamplingParams(max_tokens=1, kv_from="gen-compute/r")
    link_s = prompt * MODELS["qwen3-32b"].kv_bytes_per_token * 8 / 100e9
    for replicas, last_arrival in ((1, 2 * link_s), (2, link_s)):
        eng = engine("H20", model="qwen3-32b", gpus=8, replicas=replicas, kv_link_gbps=100.0)
        await eng.start()
        start = eng.clock.now()
        await asyncio.gather(*(eng.generate(f"r{i}", [1] * prompt, params) for i in range(2)))
        # each decodes its one token alone, as soon as its KV cache is in
        assert eng.clock.now() - start == pytest.approx(last_arrival + eng.cost.decode_step_s(1, prompt), abs=1e-5)
        await eng.close()


@virtual
async def test_a_prefill_half_holds_its_kv_cache_until_it_is_sent() -> None:
    eng = engine("H800", model="qwen3-8b", kv_link_gbps=10.0)
    await eng.start()
    prompt = eng.cost.kv_capacity_tokens // 2 + 1  # two do not fit at once
    params = SamplingParams(max_tokens=8, prefill_only=True)
    link_s = prompt * eng.cost.model.kv_bytes_per_token * 8 / 10e9
    start = eng.clock.now()
    await asyncio.gather(eng.generate("a", [1] * prompt, params), eng.generate("b", [1] * prompt, params))
    # b is admitted only once a's KV cache has left: prefill, send, prefill, send
    assert eng.clock.now() - start == pytest.approx(2 * (eng.cost.prefill_s(prompt) + link_s), abs=1e-4)
    sending = asyncio.ensure_future(eng.generate("c", [1] * prompt, params))
    await eng.clock.sleep(eng.cost.prefill_s(prompt) + link_s / 2)  # its KV cache is on the link now
    assert await eng.abort("c")
    assert (await sending).finish_reason == "abort"
    after = await eng.generate("d", [1] * prompt, SamplingParams(max_tokens=8))  # c's KV cache was freed
    assert len(after.token_ids) == 8
    await eng.close()


@virtual
async def test_the_prefix_cache_prefills_only_what_a_replica_has_not_seen() -> None:
    """A second turn whose prompt is the first turn's prompt and reply plus new tokens prefills only what follows
    their whole blocks; an unrelated prompt prefills whole; without the cache everything is prefilled."""
    params = SamplingParams(max_tokens=40, temperature=0)
    first_prompt = list(range(3, 3 + 1000))
    for prefix_cache in (True, False):
        eng = engine(prefix_cache=prefix_cache)
        await eng.start()
        first = await eng.generate("t/0", first_prompt, params)
        second_prompt = first_prompt + first.token_ids + [7] * 200  # the trajectory's next turn
        start = eng.clock.now()
        await eng.generate("t/1", second_prompt, params)
        second_s = eng.clock.now() - start
        cached = (len(first_prompt) + len(first.token_ids)) // PREFIX_BLOCK * PREFIX_BLOCK if prefix_cache else 0
        assert eng.cached_tokens == cached
        assert eng.prefilled_tokens == len(first_prompt) + len(second_prompt) - cached
        decode_s = sum(eng.cost.decode_step_s(1, len(second_prompt) + i) for i in range(40))
        assert second_s == pytest.approx(eng.cost.prefill_s(len(second_prompt) - cached) + decode_s, abs=1e-5)
        await eng.generate("u/0", [5] * 600, params)  # no block of it was seen
        assert eng.cached_tokens == cached
        await eng.close()


@virtual
async def test_a_replica_with_room_takes_the_waiting_request_whose_prefix_it_holds() -> None:
    """Two replicas; each has run one trajectory's first turn. The second turns, queued oldest first in the other
    order, each go to the replica that holds their prefix, and neither prefills its first turn's blocks again."""
    eng = engine(replicas=2, prefix_cache=True, max_batch_size=1)
    await eng.start()
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = {name: [token] * 800 for name, token in (("a", 5), ("b", 6))}
    await asyncio.gather(*(eng.generate(f"{name}/0", prompt, params) for name, prompt in prompts.items()))
    holder = {
        name: next(r.index for r in eng._replicas if _block_hashes(prompt)[0] in r.cache)
        for name, prompt in prompts.items()
    }
    assert sorted(holder.values()) == [0, 1]
    before = eng.cached_tokens
    await asyncio.gather(
        *(eng.generate(f"{name}/1", prompt + [9] * 100, params) for name, prompt in reversed(prompts.items()))
    )
    assert eng.cached_tokens - before == 2 * (800 // PREFIX_BLOCK * PREFIX_BLOCK)
    await eng.close()


def test_the_prefix_cache_forgets_the_least_recently_used_block_first() -> None:
    eng = engine(prefix_cache=True)
    eng._cache_blocks = 2
    replica = eng._replicas[0]
    eng._remember(replica, [1, 2])
    eng._remember(replica, [1])  # used again: 2 is now the oldest
    eng._remember(replica, [3])
    assert list(replica.cache) == [1, 3]


def test_a_request_waits_for_the_replica_with_its_prefix_only_while_that_one_is_not_much_busier() -> None:
    eng = engine(replicas=3, prefix_cache=True)
    busy, other, idle = eng._replicas
    busy.running = {f"r{i}": None for i in range(40)}  # type: ignore[misc]
    other.running = {f"s{i}": None for i in range(37)}  # type: ignore[misc]
    idle.running = {f"t{i}": None for i in range(38)}  # type: ignore[misc]
    assert eng._sticks(0)  # 40 <= 37 + max(2, 40 // 10)
    busy.running |= {f"u{i}": None for i in range(5)}  # type: ignore[misc]
    assert not eng._sticks(0)  # 45 > 37 + 4: it goes to the shared queue
    assert eng._sticks(1)
