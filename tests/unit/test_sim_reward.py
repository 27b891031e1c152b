"""The simulated reward (`rollart.sim.reward`): a judge's time follows the cost model; local GPUs
are reserved and queue, the service starts workers on demand (cold start), lets idle ones go, and
counts utilization as busy over live worker-seconds. On the virtual-time loop: exact and instant."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from test_sim_engine import virtual

from rollart.clock import SimClock
from rollart.rewards import ScoreInput, UnknownReward
from rollart.sim.config import SimRewardSpec
from rollart.sim.hardware import CostModel, EngineShape
from rollart.sim.reward import SimRewardPool

ITEM = ScoreInput(task="math", prompt="p", response="r", env_reward=1.0)


async def score_many(pool: SimRewardPool, n: int, tokens: int) -> tuple[float, list[float]]:
    """Simulated seconds until `n` requests sent together are scored, and their rewards."""
    start = pool.clock.now()
    item = msgspec.structs.replace(ITEM, tokens=tokens)
    outs = await asyncio.gather(*(pool.score("env-reward", item, timeout=1e6) for _ in range(n)))
    return pool.clock.now() - start, [out.reward for out in outs]


def test_a_judge_takes_the_prefill_of_the_trajectory_and_its_verdict() -> None:
    pool = SimRewardPool(SimRewardSpec(placement="local", workers=1, verdict_tokens=16), SimClock())
    cost = CostModel.build(EngineShape(gpu="H800", gpus=1), "qwen2.5-7b")
    assert pool.score_s(10_000) == pytest.approx(cost.prefill_s(10_000) + 16 * cost.decode_step_s(1, 10_008))
    assert pool.score_s(20_000) > 1.9 * cost.prefill_s(10_000)  # prefill dominates, linear in tokens


@virtual
async def test_local_gpus_are_reserved_and_requests_queue_for_them() -> None:
    spec = SimRewardSpec(placement="local", workers=2)
    async with SimRewardPool(spec, SimClock()) as pool:
        one = pool.score_s(8000)
        took, rewards = await score_many(pool, 4, 8000)
        assert took == pytest.approx(2 * one, rel=1e-4)  # 4 requests, 2 workers: two rounds
        assert rewards == [1.0] * 4  # the registered function's verdict
        await pool.clock.sleep(6 * one)  # idle, but reserved: still live
        stats = pool.stats()
        assert stats.live_workers == 2 and stats.cold_starts.max_s == 0.0
        assert stats.utilization == pytest.approx(4 * one / (2 * 8 * one), rel=1e-4)


@virtual
async def test_the_service_starts_workers_on_demand_and_releases_idle_ones() -> None:
    spec = SimRewardSpec(placement="service", workers=3, cold_start_s=10.0, idle_timeout_s=30.0, scale_up="per-request")
    async with SimRewardPool(spec, SimClock()) as pool:
        assert pool.stats().live_workers == 0  # scaled to zero: costs nothing
        one = pool.score_s(8000)
        took, _ = await score_many(pool, 5, 8000)
        stats = pool.stats()
        assert stats.peak_workers == 3  # one per waiting request, up to `workers`
        assert took == pytest.approx(10.0 + 2 * one, rel=1e-4)  # a cold start, then 5 requests on 3 workers
        await pool.clock.sleep(31.0)
        stats = pool.stats()
        assert stats.live_workers == 0 and stats.served == 5 and stats.cold_starts.count == 3
        live = 3 * (10.0 + 30.0) + 5 * one  # each worker: cold start, its jobs, 30 s idle
        assert stats.utilization == pytest.approx(5 * one / live, rel=1e-4)


@virtual
async def test_by_wait_the_service_starts_a_worker_only_when_waiting_would_outlast_a_cold_start() -> None:
    spec = SimRewardSpec(placement="service", workers=8, cold_start_s=10.0, idle_timeout_s=30.0)
    async with SimRewardPool(spec, SimClock()) as pool:
        one = pool.score_s(8000)
        few = int(10.0 / one)  # this many requests of work fit in one cold start
        took, _ = await score_many(pool, few, 8000)
        assert pool.stats().peak_workers == 1  # per-request would have started `few` (up to 8)
        assert took == pytest.approx(10.0 + few * one, rel=1e-4)
        await pool.clock.sleep(31.0)  # released
        took, _ = await score_many(pool, 4 * few, 8000)
        # 4 cold starts' worth of work: workers until each one's share is within a cold start
        assert pool.stats().peak_workers == 4
        assert took <= 10.0 + few * one + one


@virtual
async def test_by_gap_a_judge_goes_once_its_next_request_is_further_off_than_a_cold_start() -> None:
    spec = SimRewardSpec(placement="service", workers=1, cold_start_s=10.0, idle_timeout_s=60.0, release="by-gap")
    async with SimRewardPool(spec, SimClock()) as pool:
        one = pool.score_s(8000)
        item = msgspec.structs.replace(ITEM, tokens=8000)
        stream = []
        for _ in range(6):  # a steady stream, a request every 4 s: the judge is kept between them
            stream.append(asyncio.ensure_future(pool.score("env-reward", item, timeout=1e6)))
            await pool.clock.sleep(4.0)
        await asyncio.gather(*stream)
        stats = pool.stats()
        assert stats.live_workers == 1 and stats.cold_starts.count == 1
        await pool.clock.sleep(10.0)  # the stream stopped: 14 s since a request, more than a cold start
        assert pool.stats().live_workers == 0  # released at its look after a cold start, not after 60 s idle
        took, _ = await score_many(pool, 12, 8000)  # a burst, long after the last request: served, then let go
        assert pool.stats().live_workers == 0 and pool.stats().cold_starts.count == 2
        assert took == pytest.approx(10.0 + 12 * one, rel=1e-4)


@virtual
async def test_by_gap_workers_beyond_the_recent_load_go_even_while_requests_keep_coming() -> None:
    spec = SimRewardSpec(placement="service", workers=3, cold_start_s=10.0, idle_timeout_s=600.0, release="by-gap")
    async with SimRewardPool(spec, SimClock()) as pool:
        one = pool.score_s(8000)
        burst = asyncio.ensure_future(score_many(pool, 4 * int(10.0 / one), 8000))  # 4 cold starts' work
        item = msgspec.structs.replace(ITEM, tokens=8000)
        stream = []
        for _ in range(100):  # and a request a second: a third of one worker, never a gap of a cold start
            stream.append(asyncio.ensure_future(pool.score("env-reward", item, timeout=1e6)))
            await pool.clock.sleep(1.0)
        await asyncio.gather(burst, *stream)
        stats = pool.stats()
        assert stats.peak_workers == 3  # the burst started them all
        assert stats.live_workers == 1 and stats.cold_starts.count == 3  # two let go, none started again


@virtual
async def test_after_its_first_cold_start_the_service_starts_judges_warm_and_lets_them_go_sooner() -> None:
    spec = SimRewardSpec(
        placement="service", workers=4, cold_start_s=10.0, warm_start_s=2.0, idle_timeout_s=60.0, release="by-gap"
    )
    async with SimRewardPool(spec, SimClock()) as pool:
        one = pool.score_s(8000)
        item = msgspec.structs.replace(ITEM, tokens=8000)
        started = pool.clock.now()
        stream = []
        for _ in range(6):  # a request every 4 s: kept between them at a 10 s start (the by-gap test above)
            stream.append(asyncio.ensure_future(pool.score("env-reward", item, timeout=1e6)))
            await pool.clock.sleep(4.0)
        await asyncio.gather(*stream)
        stats = pool.stats()
        # The first start loads the weights from storage (10 s: the requests at 0, 4 and 8 s wait for it);
        # each later one from memory (2 s, cheaper than 4 s idle, so the judge goes between requests).
        assert stats.peak_workers == 1 and stats.cold_starts.count == 1 + 3
        assert stats.cold_starts.max_s == 10.0 and stats.cold_starts.last_s == 2.0
        assert stats.live_workers == 0 and pool.clock.now() - started == pytest.approx(24.0, rel=1e-6)
        few = int(10.0 / one)  # scaling up still waits for a cold start's work per worker
        took, _ = await score_many(pool, 3 * few, 8000)
        assert pool.stats().peak_workers == 3 and took <= 2.0 + few * one + one


@virtual
async def test_instant_scores_at_once_and_errors_come_back_clearly() -> None:
    async with SimRewardPool(SimRewardSpec(placement="instant"), SimClock()) as pool:
        took, rewards = await score_many(pool, 3, 8000)
        assert took == 0.0 and rewards == [1.0] * 3
        with pytest.raises(UnknownReward, match="no-such"):
            await pool.score("no-such", ITEM, timeout=1.0)


def test_bad_reward_settings_are_named() -> None:
    problems = dict(SimRewardSpec(model="gpt-9", workers=0, min_workers=2, warm_start_s=20.0).validate())
    assert "gpt-9" in problems["reward.model"] and "warm_start_s <= cold_start_s" in problems["reward.warm_start_s"]
    assert "reward.workers" in problems and "reward.min_workers" in problems
