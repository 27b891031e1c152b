"""Fair sharing of one reward pool among jobs (`rollart.rewards.fair`): worker time split by weight
whatever each job's request rate and cost, no credit banked while idle, and the pools' per-job
numbers. The pool tests run the simulated reward on the virtual-time loop: exact and instant."""

from __future__ import annotations

import asyncio
import collections

import pytest
from test_sim_engine import virtual

from rollart.clock import SimClock
from rollart.rewards import ScoreInput
from rollart.rewards.fair import FIRST_COST_S, FairQueue
from rollart.sim.config import SimRewardSpec
from rollart.sim.reward import SimRewardPool


def serve(queue: FairQueue[int], cost: dict[str, float], n: int) -> collections.Counter[str]:
    """Worker seconds each job got over `n` requests run one after another."""
    used: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        job, item = queue.pop()
        queue.charge(job, item, cost[job])
        used[job] += cost[job]
        queue.push(job, item)  # each job keeps one more request waiting: always backlogged
    return used


def test_one_job_is_served_first_in_first_out() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(5):
        queue.push("run", i)
    assert [queue.pop() for _ in range(5)] == [("run", i) for i in range(5)]
    assert not queue
    with pytest.raises(IndexError):
        queue.pop()


def test_backlogged_jobs_get_equal_worker_time_whatever_their_requests_cost() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(3):
        queue.push("long", i)
        queue.push("short", 100 + i)
    used = serve(queue, {"long": 3.0, "short": 1.0}, 400)
    # FIFO would give "long" 3/4 of the time (one of each in turn); fair: within one request's cost
    assert used["long"] == pytest.approx(used["short"], abs=3.0)


def test_weights_split_the_workers_in_proportion() -> None:
    queue: FairQueue[int] = FairQueue({"big": 3.0})
    for i in range(3):
        queue.push("big", i)
        queue.push("small", i)
    used = serve(queue, {"big": 1.0, "small": 1.0}, 400)
    assert used["big"] / used["small"] == pytest.approx(3.0, rel=0.02)


def test_a_job_back_from_idle_banks_no_credit() -> None:
    queue: FairQueue[int] = FairQueue()
    queue.push("a", 0)
    serve(queue, {"a": 1.0}, 100)  # "a" alone for 100 s
    for i in range(10):
        queue.push("a", i)
        queue.push("b", i)
    order = [queue.pop()[0] for _ in range(6)]
    # "b" starts at "a"'s virtual time: they alternate, b does not take the next 100 requests
    assert order.count("b") == 3 and order.count("a") == 3


def test_a_request_put_back_keeps_its_place_and_its_charge_is_undone() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push("a", "a0")
    queue.push("a", "a1")
    queue.push("b", "b0")
    job, item = queue.pop()
    assert (job, item) == ("a", "a0")  # a tie goes to the name first in order
    queue.push_front(job, item)  # the worker died before it started
    assert queue.pop() == ("a", "a0")
    assert queue.pop() == ("b", "b0")
    assert queue.remove("a", "a1") and not queue.remove("a", "a1")
    assert len(queue) == 0 and queue.depth("a") == 0


def test_the_first_charge_is_an_estimate_corrected_when_the_request_ends() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(4):
        queue.push("a", i)
        queue.push("b", i)
    job, item = queue.pop()
    assert job == "a"
    # "a" is charged FIRST_COST_S until its request ends; "b" is next, then "a" again
    assert queue.pop()[0] == "b"
    queue.charge("a", item, FIRST_COST_S / 10)  # it was cheap: "a" is behind "b" now
    assert queue.pop()[0] == "a"


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="weights must be > 0"):
        FairQueue({"a": 0.0})


ITEM = ScoreInput(task="math", prompt="p", response="r", env_reward=1.0, tokens=8000)


@virtual
async def test_a_job_that_floods_the_shared_pool_does_not_hold_back_another() -> None:
    spec = SimRewardSpec(placement="local", workers=1)
    async with SimRewardPool(spec, SimClock()) as pool:
        one = pool.score_s(ITEM.tokens)
        started = pool.clock.now()
        flood = [asyncio.ensure_future(pool.score("env-reward", ITEM, timeout=1e6, job="a")) for _ in range(20)]
        await pool.clock.sleep(one / 2)  # "a"'s 20 requests are queued (one running)
        await pool.score("env-reward", ITEM, timeout=1e6, job="b")
        # served right after "a"'s running request, not after its 19 waiting ones (FIFO: 20 x one)
        assert pool.clock.now() - started == pytest.approx(2 * one, rel=1e-4)
        await asyncio.gather(*flood)
        jobs = pool.stats().jobs
        assert (jobs["a"].served, jobs["b"].served) == (20, 1)
        assert jobs["a"].busy_s == pytest.approx(20 * one, rel=1e-4)
        assert jobs["b"].share == pytest.approx(1 / 21, rel=1e-4)
        assert jobs["b"].wait_mean_s == pytest.approx(one / 2, rel=1e-4)
        assert jobs["a"].queue_depth == 0 and jobs["a"].weight == 1.0


@virtual
async def test_two_backlogged_jobs_split_the_service_by_weight() -> None:
    spec = SimRewardSpec(placement="local", workers=2)
    async with SimRewardPool(spec, SimClock(), job_weights={"a": 3.0}) as pool:
        one = pool.score_s(ITEM.tokens)
        calls = [
            asyncio.ensure_future(pool.score("env-reward", ITEM, timeout=1e6, job=job))
            for _ in range(40)
            for job in ("a", "b")
        ]
        await pool.clock.sleep(20 * one)  # 40 worker-slots of time: both still backlogged
        jobs = pool.stats().jobs
        assert jobs["a"].busy_s / jobs["b"].busy_s == pytest.approx(3.0, rel=0.1)
        await asyncio.gather(*calls)
