"""SampleBuffer, dispenser admission and groups with redundancy, without any network."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from rollart.protocol.messages import GroupDone, GroupFailed, GroupTask, Trajectory
from rollart.rollout.buffer import SampleBuffer
from rollart.rollout.config import RolloutSpec, TaskSpec
from rollart.rollout.dispenser import Dispenser
from rollart.rollout.group import CALIBRATE_EVERY, MIN_SAMPLES, GroupDeadlines, run_group
from rollart.rollout.staleness import StalenessBound


def trajectory(tid: str, started: int = 0, group: str = "g1") -> Trajectory:
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        task="t",
        seed=1,
        prompt_ids=[1],
        response_ids=[2],
        response_mask=[1],
        logprobs=[-0.5],
        versions=[started],
        reward=1.0,
        env_reward=1.0,
        turns=1,
        finish="done",
        started_at_version=started,
        started_at=0.0,
        finished_at=1.0,
        env_wait_s=0.0,
        gen_wait_s=0.0,
    )


def group(gid: str, *started: int) -> GroupDone:
    return GroupDone(gid, [trajectory(f"{gid}.{i}", s, gid) for i, s in enumerate(started)])


def spec(**overrides: object) -> RolloutSpec:
    base: dict[str, object] = {
        "tasks": [TaskSpec(name="a", env="copy-reverse"), TaskSpec(name="b", env="frozen-lake", weight=3.0)],
        "group_size": 2,
        "redundancy": 1,
        "batch_groups": 2,
        "alpha": 1,
    }
    return RolloutSpec(**(base | overrides))  # type: ignore[arg-type]


async def test_buffer_refuses_and_drops_what_breaks_the_alpha_bound() -> None:
    buffer = SampleBuffer(batch_groups=2, bound=StalenessBound(1))
    assert buffer.put(group("g1", 3, 3), version=4) == (True, "")
    accepted, why = buffer.put(group("g2", 2, 3), version=4)
    assert not accepted and "started at version 2, the policy is at 4" in why
    assert buffer.put(group("g3", 4, 4), version=4)[0]
    dropped = buffer.drop_stale(version=5)  # 3 < 5 - 1: g1 goes, g3 stays
    assert [g.group_id for g in dropped] == ["g1"]
    assert buffer.stats() == {
        "depth": 1,
        "accepted": 2,
        "refused_stale": 1,
        "dropped_stale": 1,
        "taken": 0,
        "uniform": 0,
    }


async def test_buffer_take_waits_for_a_whole_batch_oldest_first() -> None:
    buffer = SampleBuffer(batch_groups=2, bound=StalenessBound(0))
    taker = asyncio.ensure_future(buffer.take())
    buffer.put(group("g1", 0), version=0)
    await asyncio.sleep(0)
    assert not taker.done()
    buffer.put(group("g2", 0), version=0)
    buffer.put(group("g3", 0), version=0)
    batch = await asyncio.wait_for(taker, 1)
    assert [g.group_id for g in batch] == ["g1", "g2"] and len(buffer) == 1


async def test_buffer_take_hands_out_the_groups_that_started_earliest_first() -> None:
    buffer = SampleBuffer(batch_groups=2, bound=StalenessBound(2))
    for gid, start in [("young", 3), ("old", 1), ("middle", 2), ("also-young", 3)]:
        buffer.put(group(gid, start, 3), version=3)
    batch = await asyncio.wait_for(buffer.take(), 1)
    assert [g.group_id for g in batch] == ["old", "middle"]  # a bump to 4 would have dropped "old"
    assert [g.group_id for g in buffer.peek()] == ["young", "also-young"]  # the rest keep arrival order


def rewarded(gid: str, *rewards: float, started: int = 0) -> GroupDone:
    done = group(gid, *[started] * len(rewards))
    scored = zip(done.trajectories, rewards, strict=True)
    return GroupDone(gid, [msgspec.structs.replace(t, reward=reward) for t, reward in scored])


async def test_dynamic_sampling_counts_only_groups_with_signal_and_hands_the_rest_beside() -> None:
    buffer = SampleBuffer(batch_groups=2, bound=StalenessBound(1), dynamic_sampling=True, max_uniform_batches=2)
    taker = asyncio.ensure_future(buffer.take())
    buffer.put(rewarded("solved", 1.0, 1.0), version=0)
    buffer.put(rewarded("learning", 0.0, 1.0), version=0)
    buffer.put(rewarded("hopeless", 0.0, 0.0), version=0)
    await asyncio.sleep(0)
    assert not taker.done() and len(buffer) == 1  # admission sees the one group with signal
    buffer.put(rewarded("partial", 0.25, 0.5), version=0)
    batch = await asyncio.wait_for(taker, 1)
    assert [g.group_id for g in batch] == ["learning", "partial", "solved", "hopeless"]
    assert buffer.stats()["uniform"] == 2 and buffer.stats()["taken"] == 4 and buffer.stats()["depth"] == 0


async def test_dynamic_sampling_steps_anyway_when_no_group_has_signal() -> None:
    buffer = SampleBuffer(batch_groups=2, bound=StalenessBound(1), dynamic_sampling=True, max_uniform_batches=2)
    taker = asyncio.ensure_future(buffer.take())
    for i in range(3):
        buffer.put(rewarded(f"u{i}", 1.0, 1.0), version=0)
        await asyncio.sleep(0)
        assert not taker.done()
    buffer.put(rewarded("u3", 0.0, 0.0), version=0)  # 2 batches' worth of uniform groups
    assert [g.group_id for g in await asyncio.wait_for(taker, 1)] == ["u0", "u1", "u2", "u3"]


async def test_dynamic_sampling_drops_stale_uniform_groups_too() -> None:
    buffer = SampleBuffer(batch_groups=2, bound=StalenessBound(0), dynamic_sampling=True)
    buffer.put(rewarded("old", 1.0, 1.0, started=0), version=0)
    buffer.put(rewarded("new", 1.0, 1.0, started=1), version=1)
    assert [g.group_id for g in buffer.drop_stale(version=1)] == ["old"]
    assert [g.group_id for g in buffer.peek()] == ["new"]


@pytest.mark.parametrize("alpha", [0, 1, 2])
async def test_admission_keeps_in_flight_plus_buffered_within_alpha(alpha: int) -> None:
    buffered = [0]
    dispenser = Dispenser(spec(alpha=alpha, lookahead="alpha"), buffered=lambda: buffered[0])
    limit = (alpha + 1) * 2
    granted = [await dispenser.grant("env-0", 0, wait_s=0.01) for _ in range(limit)]
    assert all(granted) and len({g.group_id for g in granted if g}) == limit
    assert await dispenser.grant("env-0", 0, wait_s=0.01) is None  # at the limit: nothing more starts
    first = granted[0]
    assert first is not None
    dispenser.complete(first.group_id)
    buffered[0] = 1  # it went into the buffer: still counts against the limit
    assert await dispenser.grant("env-0", 0, wait_s=0.01) is None
    buffered[0] = 0  # the trainer took it
    dispenser.changed()
    assert await dispenser.grant("env-0", 0, wait_s=0.01) is not None


@pytest.mark.parametrize("alpha", [0, 1, 2])
async def test_while_the_trainer_trains_admission_counts_one_batch_fewer(alpha: int) -> None:
    """The batch after the one in training is taken a version later, so work started meanwhile can fill
    only the batches up to version + alpha after it (AReaL's rule: every group submitted counts, trained
    ones too, against (version + alpha + 1) batches)."""
    dispenser = Dispenser(spec(alpha=alpha, batch_groups=2, lookahead="alpha"), buffered=lambda: 0)
    dispenser.set_training(True)
    granted = [await dispenser.grant("env-0", 0, wait_s=0.01) for _ in range(2 * alpha + 1)]
    assert sum(g is not None for g in granted) == 2 * alpha  # none at alpha 0: all of it would be stale
    waiting = asyncio.ensure_future(dispenser.grant("env-0", 1, wait_s=1))
    await asyncio.sleep(0.01)
    dispenser.set_training(False)  # the version is out: one batch more fits
    assert await waiting is not None
    assert dispenser.limit == 2 * (alpha + 1)


@pytest.mark.parametrize("lookahead", ["adaptive", "alpha"])
async def test_a_trainer_that_finds_its_batches_ready_gets_less_work_started_ahead(lookahead: str) -> None:
    dispenser = Dispenser(spec(alpha=2, batch_groups=2, lookahead=lookahead), buffered=lambda: 0)
    adaptive = lookahead == "adaptive"
    # until the trainer takes a batch: alpha batches ahead, or adaptive, one (alpha + 1 batches started
    # at once would make the first as late as the last)
    assert dispenser.limit == (4 if adaptive else 6)
    dispenser.pace(batch_was_ready=False)  # the trainer waited for its first batch: one more ahead
    assert dispenser.limit == 6
    limits = []
    # ready 3 in a row sheds one batch ahead; a wait adds one back and starts the count again
    for ready in [True] * 5 + [False] + [True] * 9:
        dispenser.pace(batch_was_ready=ready)
        limits.append(dispenser.limit)
    if adaptive:
        assert limits == [6, 6, 4, 4, 4, 6, 6, 6, 4, 4, 4, 2, 2, 2, 2]  # one batch at a time, 0 to alpha
    else:
        assert set(limits) == {6}
    granted = [await dispenser.grant("env-0", 0, wait_s=0.01) for _ in range(6)]
    assert sum(g is not None for g in granted) == (2 if adaptive else 6)  # the next batch only
    waiting = asyncio.ensure_future(dispenser.grant("env-0", 0, wait_s=0.5))
    await asyncio.sleep(0.01)
    dispenser.pace(batch_was_ready=False)  # it had to wait: room for one more batch, at once
    assert (await waiting is not None) == adaptive
    zero = Dispenser(spec(alpha=0, batch_groups=2), buffered=lambda: 0)
    zero.pace(batch_was_ready=False)
    assert zero.limit == 2  # alpha 0 (the sync baseline): never ahead


async def test_room_wakes_the_oldest_waiting_grants_only_as_many_as_fit() -> None:
    dispenser = Dispenser(spec(alpha=0, batch_groups=1), buffered=lambda: 0)
    first = await dispenser.grant("env-0", 0, wait_s=0.01)
    assert first is not None
    waiting = [asyncio.ensure_future(dispenser.grant(f"env-{i}", 0, wait_s=60)) for i in range(1, 5)]
    await asyncio.sleep(0)
    woken_before = sum(w.done() for w in waiting)
    dispenser.complete(first.group_id)  # room for one: the oldest waiter gets it, the others sleep on
    for _ in range(3):
        await asyncio.sleep(0)
    assert woken_before == 0
    assert [w.done() for w in waiting] == [True, False, False, False]
    assert waiting[0].result() is not None
    dispenser.finish()  # the run is over: every waiter is told at once
    assert await asyncio.gather(*waiting[1:]) == [None, None, None]


async def test_a_grant_that_waited_for_room_carries_the_version_of_when_it_was_granted() -> None:
    dispenser = Dispenser(spec(alpha=0, batch_groups=1), buffered=lambda: 0)
    first = await dispenser.grant("env-0", 3, wait_s=0.01)
    assert first is not None and first.version == 3
    policy = [3]
    waiting = asyncio.ensure_future(dispenser.grant("env-1", lambda: policy[0], wait_s=60))
    await asyncio.sleep(0)
    policy[0] = 4  # the batch was taken and trained on while the grant waited
    dispenser.complete(first.group_id)
    task = await waiting
    assert task is not None and task.version == 4


async def test_failed_groups_are_reissued_with_their_seed_and_give_capacity_back() -> None:
    dispenser = Dispenser(spec(alpha=0, batch_groups=1), buffered=lambda: 0)
    task = await dispenser.grant("env-0", 0, wait_s=0.01)
    assert task is not None
    assert await dispenser.grant("env-0", 0, wait_s=0.01) is None
    dispenser.reissue(task.group_id, "2 of 2 failed")
    again = await dispenser.grant("env-1", 0, wait_s=0.01)
    assert again is not None
    assert (again.task, again.seed) == (task.task, task.seed) and again.group_id != task.group_id
    dispenser.release_env_host("env-1", "restarted")
    third = await dispenser.grant("env-0", 0, wait_s=0.01)
    assert third is not None and third.seed == task.seed


async def test_a_seed_that_keeps_failing_is_given_up_for_a_fresh_one() -> None:
    dispenser = Dispenser(spec(alpha=0, batch_groups=1, group_attempts=3), buffered=lambda: 0)
    first = await dispenser.grant("env-0", 0, wait_s=0.01)
    assert first is not None
    tries = [first]
    for _ in range(2):
        dispenser.reissue(tries[-1].group_id, "2 of 2 failed", failed=True)
        tries.append(await dispenser.grant("env-0", 0, wait_s=0.01))  # type: ignore[arg-type]
    assert {t.seed for t in tries} == {first.seed} and dispenser.abandoned == 0
    dispenser.reissue(tries[-1].group_id, "2 of 2 failed", failed=True)  # third failed try
    fresh = await dispenser.grant("env-0", 0, wait_s=0.01)  # the slot it held is free again
    assert fresh is not None and fresh.seed != first.seed
    assert dispenser.abandoned == 1 and dispenser.stats()["abandoned"] == 1
    dispenser.reissue(fresh.group_id, "not returned")  # lost, not failed: its seed runs again
    assert (await dispenser.grant("env-0", 0, wait_s=0.01)).seed == fresh.seed  # type: ignore[union-attr]


async def test_task_mix_follows_the_weights() -> None:
    dispenser = Dispenser(spec(alpha=1000, lookahead="alpha"), buffered=lambda: 0)
    names = [(await dispenser.grant("e", 0, wait_s=0.01)).task for _ in range(400)]  # type: ignore[union-attr]
    assert 0.65 < names.count("b") / len(names) < 0.85  # weight 3 of 4


async def test_group_keeps_the_first_g_and_cancels_the_extras() -> None:
    cancelled: list[str] = []
    release = {f"g1.{i}": asyncio.Event() for i in range(3)}

    async def one(tid: str) -> Trajectory:
        try:
            await release[tid].wait()
        except asyncio.CancelledError:
            cancelled.append(tid)
            raise
        return trajectory(tid)

    run = asyncio.ensure_future(run_group(GroupTask("g1", "t", 1, group_size=2, redundancy=1, version=0), one))
    release["g1.2"].set()
    release["g1.0"].set()
    outcome = await asyncio.wait_for(run, 1)
    assert isinstance(outcome, GroupDone)
    assert sorted(t.trajectory_id for t in outcome.trajectories) == ["g1.0", "g1.2"]
    assert cancelled == ["g1.1"] and outcome.cancelled == 1


async def test_group_fails_as_soon_as_g_cannot_be_reached() -> None:
    async def one(tid: str) -> Trajectory:
        if tid != "g1.0":
            raise RuntimeError(f"env of {tid} broke")
        await asyncio.Event().wait()  # never finishes: must be cancelled
        raise AssertionError

    outcome = await asyncio.wait_for(run_group(GroupTask("g1", "t", 1, 2, 1, 0), one), 1)
    assert isinstance(outcome, GroupFailed)
    assert outcome.reason.startswith("0 of 2 trajectories finished") and "env of g1.1 broke" in outcome.reason


def test_a_group_deadline_is_the_quantile_of_the_times_of_groups_run_without_one() -> None:
    deadlines = GroupDeadlines(0.9)
    assert deadlines.deadline_s("t") is None  # nothing known yet
    deadlines.record("t", [float(i) for i in range(1, MIN_SAMPLES)])
    assert deadlines.deadline_s("t") is None  # still too few
    deadlines.record("t", [float(i) for i in range(MIN_SAMPLES, 101)])  # times 1..100
    asked = [deadlines.deadline_s("t") for _ in range(4 * CALIBRATE_EVERY)]
    assert asked.count(None) == 4  # one group in CALIBRATE_EVERY runs whole: its times stay unbiased
    assert {d for d in asked if d is not None} == {90.0}
    assert deadlines.deadline_s("other") is None  # per task


def test_adaptive_redundancy_gives_extras_where_the_tail_is_long_and_none_where_times_are_even() -> None:
    deadlines = GroupDeadlines(0.9)
    assert deadlines.extras("heavy", 8, 1, 4) == 1  # nothing known yet: the floor
    rng = random.Random(0)
    deadlines.record("even", [10.0 + rng.random() for _ in range(200)])
    deadlines.record("heavy", [rng.lognormvariate(0.0, 2.0) for _ in range(200)])
    assert deadlines.extras("even", 8, 0, 4) == 0  # an extra costs a trajectory and saves nothing
    # the 8th of 8 is the slowest of a long tail; the 8th of 12 is near the median: 4 extras are cheaper
    assert deadlines.extras("heavy", 8, 0, 4) == 4
    assert deadlines.extras("heavy", 8, 0, 0) == 0  # never more than allowed


async def test_a_group_past_its_deadline_is_done_with_at_least_min_size_and_cuts_the_rest() -> None:
    deadlines = GroupDeadlines(0.5)
    deadlines.record("t", [0.05] * MIN_SAMPLES)  # the deadline: 50 ms
    deadlines.groups["t"] = 1  # not a calibrating group next
    finish = {"g1.0": 0.0, "g1.1": 0.01, "g1.2": 0.02, "g1.3": 0.2, "g1.4": 5.0}  # two stragglers
    cancelled: list[str] = []

    async def one(tid: str) -> Trajectory:
        try:
            await asyncio.sleep(finish[tid])
        except asyncio.CancelledError:
            cancelled.append(tid)
            raise
        return trajectory(tid)

    task = GroupTask("g1", "t", 1, group_size=5, redundancy=0, version=0, min_size=3)
    outcome = await asyncio.wait_for(run_group(task, one, deadlines), 1)
    assert isinstance(outcome, GroupDone)
    assert sorted(t.trajectory_id for t in outcome.trajectories) == ["g1.0", "g1.1", "g1.2"]
    assert sorted(cancelled) == ["g1.3", "g1.4"] and (outcome.cancelled, outcome.cut) == (2, 2)
    # Fewer than min_size by the deadline: it waits for the min_size-th, then stops at once.
    finish.update({"g1.1": 0.1, "g1.2": 0.15})
    cancelled.clear()
    outcome = await asyncio.wait_for(run_group(task, one, deadlines), 1)
    assert isinstance(outcome, GroupDone)
    assert sorted(t.trajectory_id for t in outcome.trajectories) == ["g1.0", "g1.1", "g1.2"]
    # Without min_size (evaluation, or the run's default) the same group waits for all five.
    whole = await asyncio.wait_for(run_group(msgspec.structs.replace(task, min_size=0), one, deadlines), 6)
    assert isinstance(whole, GroupDone) and len(whole.trajectories) == 5 and whole.cut == 0


async def test_a_calibrating_group_runs_whole_and_records_every_time() -> None:
    deadlines = GroupDeadlines(0.5)

    async def one(tid: str) -> Trajectory:
        await asyncio.sleep(0.01 * int(tid.rsplit(".", 1)[1]))
        return trajectory(tid)

    task = GroupTask("g1", "t", 1, group_size=3, redundancy=1, version=0, min_size=2)
    outcome = await asyncio.wait_for(run_group(task, one, deadlines), 1)
    assert isinstance(outcome, GroupDone) and len(outcome.trajectories) == 3 and outcome.cut == 0
    times = list(deadlines.times["t"])
    assert len(times) == 4 and times == sorted(times)  # the extra's too, at its cancellation
    assert times[0] < 0.01 + 0.05 and times[2] >= 0.02


async def test_turn_barrier_releases_a_turn_when_every_live_trajectory_reached_it() -> None:
    from rollart.rollout.barrier import TurnBarrier

    barrier = TurnBarrier()
    for _ in range(3):
        barrier.join()
    first = asyncio.ensure_future(barrier.wait())
    second = asyncio.ensure_future(barrier.wait())
    await asyncio.sleep(0)
    assert not first.done() and not second.done()  # the third has not arrived
    barrier.leave()  # ... and never will: it finished
    await asyncio.wait_for(asyncio.gather(first, second), 1)
    again = asyncio.ensure_future(barrier.wait())  # the next turn waits for the other survivor
    await asyncio.sleep(0)
    assert not again.done()
    await asyncio.wait_for(asyncio.gather(barrier.wait(), again), 1)


def test_rollout_settings_out_of_range_are_named() -> None:
    problems = dict(spec(group_attempts=0, task_wait_s=31.0).validate())
    assert problems == {
        "group_attempts": "expected an integer >= 1; got 0",
        "task_wait_s": "expected a value in [0, 30]; got 31.0",
    }
    problems = dict(spec(group_size=4, min_group_size=1, deadline_quantile=1.0).validate())
    assert problems == {
        "min_group_size": "expected an integer from 2 (a group needs two to compare) to group_size (4) or null; got 1",
        "deadline_quantile": "expected a value in (0, 1); got 1.0",
    }
    assert dict(spec(group_size=4, min_group_size=5).validate()).keys() == {"min_group_size"}
    assert not spec(group_size=4, min_group_size=4).validate()
    assert dict(spec(redundancy=2, max_redundancy=1).validate()) == {
        "max_redundancy": "expected >= redundancy (2) or null; got 1"
    }
