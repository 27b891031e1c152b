"""Reward functions, the registry, and the elastic reward pool with real spawned worker processes.

Each pool test spawns one or two workers (~0.2-1 s each), so the pools are small and the
waits are on pool events (`wait_until`), never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from rollart.errors import ConfigError, DeadlineExceeded
from rollart.rewards import (
    RewardError,
    RewardPool,
    ScoreInput,
    ScoreOutput,
    UnknownReward,
    env_reward,
    exact_answer,
    get_reward,
    last_boxed,
    register_reward,
    registered_rewards,
    tiny_rm,
    unregister_reward,
)
from rollart.rewards import functions as reward_functions
from rollart.rewards.testing import register_testing_rewards, sleep

register_testing_rewards()


def item(response: str = "", **kw: object) -> ScoreInput:
    return ScoreInput(task="t", prompt="p", response=response, **kw)  # type: ignore[arg-type]


# -- built-in functions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{41} no wait, \\boxed{ 42 }", "42", 1.0),  # the last box counts; spaces stripped
        ("\\boxed{43}", "42", 0.5),  # one of two positions
        ("\\boxed{420}", "42", 2 / 3),  # over the longer length
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 10 / 11),
    ],
)
def test_exact_answer_scores_the_last_box_with_partial_credit(response: str, answer: str, reward: float) -> None:
    out = exact_answer(item(response, answer=answer))
    assert out.reward == pytest.approx(reward)
    assert out.details["exact"] is (reward == 1.0)


@pytest.mark.parametrize("response", ["42", "\\boxed{42", "\\boxed{4\\boxed{2"])
def test_exact_answer_without_a_closed_box_is_a_format_error(response: str) -> None:
    out = exact_answer(item(response, answer="42"))
    assert out.reward == 0.0
    assert out.details["format_error"] is True


def test_exact_answer_grades_the_last_complete_box_as_the_envs_read_it() -> None:
    # A reply cut off inside a second box keeps its first, complete answer (it was a format error
    # here while the envs accepted it as an action: one rule now, `rollart.envs.answers`).
    out = exact_answer(item("\\boxed{42} then \\boxed{\\frac{1}{2}", answer="42"))
    assert out.reward == 1.0 and out.details == {"extracted": "42", "exact": True}
    out = exact_answer(item("\\boxed{1} and \\boxed{\\frac{1}{2}", answer="42"))
    assert out.reward == 0.0 and out.details == {"extracted": "1", "exact": False}


def test_last_boxed_keeps_nested_braces() -> None:
    assert last_boxed("x \\boxed{a{b{c}}d} y") == "a{b{c}}d"
    assert last_boxed("nothing here") is None


def test_exact_answer_without_reference_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match=r"exact-answer: task 't' gave no reference answer"):
        exact_answer(item("\\boxed{1}"))


def test_env_reward_passes_through_and_rejects_missing_or_nan() -> None:
    assert env_reward(item(env_reward=-0.5)).reward == -0.5
    with pytest.raises(RewardError, match=r"env-reward: .*no environment reward"):
        env_reward(item())
    with pytest.raises(RewardError, match="non-finite"):
        env_reward(item(env_reward=math.nan))


def test_tiny_rm_is_deterministic_and_in_unit_interval() -> None:
    texts = ["", "hello", "\\boxed{42}", "x" * 10_000, "ünïcödé ✓"]
    first = [tiny_rm(item(t)).reward for t in texts]
    reward_functions._MODELS.clear()  # a fresh worker builds the model again: same seed, same scores
    assert [tiny_rm(item(t)).reward for t in texts] == first
    assert all(0.0 <= r <= 1.0 for r in first)
    assert len(set(first)) > 1  # it does look at the text


# -- registry -------------------------------------------------------------------------------


def test_registry_knows_builtins_and_suggests_close_names() -> None:
    assert {"exact-answer", "env-reward", "tiny-rm"} <= set(registered_rewards())
    assert get_reward("env-reward") is env_reward
    with pytest.raises(UnknownReward, match=r"unknown reward function 'exact-answr'.*did you mean 'exact-answer'"):
        get_reward("exact-answr")
    assert issubclass(UnknownReward, ConfigError) and issubclass(UnknownReward, RewardError)


def test_registry_refuses_duplicates_and_unpicklable_functions() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_reward("env-reward", exact_answer)
    with pytest.raises(ConfigError, match="not importable by reference"):
        register_reward("lambda", lambda x: ScoreOutput(reward=0.0))
    register_reward("test-alias", sleep)
    register_reward("test-alias", env_reward, overwrite=True)
    assert get_reward("test-alias") is env_reward
    unregister_reward("test-alias")
    assert "test-alias" not in registered_rewards()


def test_pool_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="min_workers"):
        RewardPool(min_workers=3, max_workers=2)
    with pytest.raises(ConfigError, match="idle_timeout_s"):
        RewardPool(idle_timeout_s=0)


# -- pool -------------------------------------------------------------------------------------


async def test_pool_cold_starts_scales_to_max_and_back_to_min() -> None:
    async with RewardPool(min_workers=0, max_workers=2, scale_up_queue_per_worker=1, idle_timeout_s=0.5) as pool:
        assert pool.stats().live_workers == 0
        out = await pool.score("exact-answer", item("\\boxed{42}", answer="42"), timeout=30)
        assert out.reward == 1.0
        stats = pool.stats()
        assert stats.cold_starts.count == 1 and stats.cold_starts.last_s > 0 and stats.live_workers == 1

        outs = await asyncio.gather(*(pool.score("test-sleep", item(meta={"s": 0.2}), timeout=30) for _ in range(6)))
        assert [o.reward for o in outs] == [1.0] * 6
        stats = pool.stats()
        assert stats.peak_workers == 2  # the queue asked for more; max_workers said no
        assert stats.served == 7 and stats.utilization > 0

        stats = await pool.wait_until(lambda s: s.live_workers == 0, timeout=10)  # idle 0.5 s: both retire
        assert (stats.crashed, stats.cold_starts.count, stats.peak_workers) == (0, 2, 2)


async def test_pool_by_gap_lets_a_worker_go_once_no_request_is_due_within_a_cold_start() -> None:
    async with RewardPool(max_workers=2, scale_up_queue_per_worker=1, idle_timeout_s=60, release="by-gap") as pool:
        outs = await asyncio.gather(*(pool.score("test-sleep", item(meta={"s": 0.2}), timeout=30) for _ in range(6)))
        assert [o.reward for o in outs] == [1.0] * 6 and pool.stats().peak_workers == 2
        cold = pool.stats().cold_starts.mean_s
        # No request since the burst: each is let go within about a cold start of its last job, where the
        # idle release would keep both for 60 s.
        stats = await pool.wait_until(lambda s: s.live_workers == 0, timeout=10 + 3 * cold)
        assert (stats.crashed, stats.cold_starts.count) == (0, 2)
    async with RewardPool(max_workers=1, idle_timeout_s=60, release="by-gap") as pool:
        stream = []
        for _ in range(40):  # a steady stream, a request every 10 ms, well within a cold start: kept throughout
            stream.append(asyncio.ensure_future(pool.score("env-reward", item(env_reward=1.0), timeout=30)))
            await asyncio.sleep(0.01)
        await asyncio.gather(*stream)
        stats = pool.stats()
        assert stats.cold_starts.mean_s > 0.03  # the premise: a gap of 10 ms is well within a cold start
        assert stats.live_workers == 1 and stats.cold_starts.count == 1


async def test_pool_worker_crash_fails_only_its_request() -> None:
    async with RewardPool(min_workers=1, max_workers=1) as pool:
        crash = asyncio.create_task(pool.score("test-crash", item(), timeout=30))
        after = asyncio.create_task(pool.score("env-reward", item(env_reward=0.25), timeout=30))
        with pytest.raises(RewardError, match=r"reward worker crashed \(exit code 3\) while running 'test-crash'"):
            await crash
        assert (await after).reward == 0.25  # queued behind the crash, served by the replacement
        with pytest.raises(RewardError, match="'test-raise' failed: ValueError: bug in reward"):
            await pool.score("test-raise", item(), timeout=30)  # a buggy function does not kill its worker
        stats = pool.stats()
        assert (stats.crashed, stats.failed, stats.served, stats.cold_starts.count) == (1, 2, 1, 2)
        assert stats.live_workers == 1


async def test_pool_deadlines_and_bad_input() -> None:
    async with RewardPool(min_workers=1, max_workers=1) as pool:
        running = asyncio.create_task(pool.score("test-sleep", item(meta={"s": 0.5}), timeout=0.1))
        queued = asyncio.create_task(pool.score("env-reward", item(env_reward=1.0), timeout=0.1))
        with pytest.raises(DeadlineExceeded, match="was running"):
            await running
        with pytest.raises(DeadlineExceeded, match="was still queued"):
            await queued
        assert pool.stats().queue_depth == 0
        # The worker finishes the abandoned sleep, then runs this; the function's message survives.
        with pytest.raises(RewardError, match="exact-answer: task 't' gave no reference answer"):
            await pool.score("exact-answer", item("\\boxed{1}"), timeout=30)
        with pytest.raises(UnknownReward, match="did you mean 'env-reward'"):
            await pool.score("env-rewrd", item(), timeout=30)
        stats = pool.stats()
        assert (stats.timed_out, stats.failed, stats.served, stats.crashed) == (2, 3, 0, 0)


async def test_pool_close_fails_pending_requests() -> None:
    pool = RewardPool(min_workers=1, max_workers=1)
    await pool.start()
    running = asyncio.create_task(pool.score("test-sleep", item(meta={"s": 30}), timeout=60))
    queued = asyncio.create_task(pool.score("env-reward", item(env_reward=1.0), timeout=60))
    await pool.wait_until(lambda s: s.busy_workers == 1 and s.queue_depth == 1, timeout=10)
    await pool.close()
    with pytest.raises(RewardError, match="closed while 'test-sleep' was running"):
        await running
    with pytest.raises(RewardError, match="closed before the request ran"):
        await queued
    stats = pool.stats()
    assert (stats.live_workers, stats.crashed) == (0, 0)
    with pytest.raises(RewardError, match="reward pool is closed"):
        await pool.score("env-reward", item(env_reward=1.0), timeout=1)


async def test_pool_start_fails_clearly_when_workers_cannot_start() -> None:
    pool = RewardPool(min_workers=1, max_workers=1, preload=("rollart.no_such_module",))
    with pytest.raises(RewardError, match=r"preload of 'rollart\.no_such_module' failed: ModuleNotFoundError"):
        await pool.start()
    assert pool.stats().crashed == 2  # one retry, then it gives up


@pytest.mark.slow  # torch is imported in the worker too: seconds on a busy 2-core host
async def test_pool_tiny_rm_scores_like_in_process() -> None:
    texts = ["hello", "\\boxed{42}"]
    async with RewardPool(min_workers=1, max_workers=1, preload=("torch",)) as pool:
        assert pool.stats().cold_starts.count == 1  # torch imported before Ready: part of the cold start
        outs = [await pool.score("tiny-rm", item(t), timeout=60) for t in texts]
    assert [o.reward for o in outs] == [tiny_rm(item(t)).reward for t in texts]
