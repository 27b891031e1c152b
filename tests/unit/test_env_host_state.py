"""The env-host's rollout state (`RolloutState`) and the one builder of a turn's request, without any network:
which trajectories a new version aborts, what the run's end cancels, how trajectories are counted, which
weights a turn may be served with."""

from __future__ import annotations

import asyncio

import pytest

from rollart.envs import EnvFailure
from rollart.nodes.env_host_state import ENV_HOST_COUNTS, RolloutState
from rollart.protocol.messages import GroupTask
from rollart.rollout.config import SamplingSpec
from rollart.rollout.staleness import StalenessBound
from rollart.rollout.turns import turn_request


class Routing:
    """What the state asks of its proxy here: how it describes its routing."""

    def describe(self) -> dict[str, object]:
        return {"generators": {}}


def state(alpha: int = 1, *, train: bool = True) -> RolloutState:
    return RolloutState(Routing(), StalenessBound(alpha), train=train)  # type: ignore[arg-type]


def group(version: int = 0, *, evaluation: bool = False) -> GroupTask:
    return GroupTask("g", "t", seed=1, group_size=2, redundancy=0, version=version, evaluation=evaluation)


async def play(rollout: RolloutState, trajectory_id: str, group: GroupTask, start: int | None) -> None:
    """A trajectory that starts generating at version `start` (None: never), then waits to be cancelled."""
    with rollout.playing(trajectory_id):
        if start is not None:
            rollout.on_start(trajectory_id, group)(start)
        await asyncio.Event().wait()


async def test_a_new_version_aborts_only_what_started_too_early_and_never_an_evaluation() -> None:
    rollout = state()
    plays = {
        "old": asyncio.create_task(play(rollout, "old", group(), 0)),
        "new": asyncio.create_task(play(rollout, "new", group(), 2)),
        "eval": asyncio.create_task(play(rollout, "eval", group(evaluation=True), 0)),
        "waiting": asyncio.create_task(play(rollout, "waiting", group(), None)),  # not generated yet
    }
    await asyncio.sleep(0)
    assert sorted(rollout.running) == ["new", "old"] and len(rollout.live) == 4
    rollout.saw_version(3)
    rollout.abort_stale(3, min_start=2)
    await asyncio.wait([plays["old"]])
    assert plays["old"].cancelled() and not any(plays[t].done() for t in ("new", "eval", "waiting"))
    assert rollout.counts["aborted_stale"] == 1 and "old" not in rollout.live
    rollout.run_over()
    await asyncio.wait(plays.values())
    assert rollout.over() and all(p.cancelled() for p in plays.values())
    assert not rollout.live and not rollout.running
    assert rollout.counts["trajectories_done"] == rollout.counts["trajectories_failed"] == 0


async def test_trajectories_are_counted_as_they_end() -> None:
    rollout = state()

    async def ending(trajectory_id: str, error: BaseException | None) -> None:
        with rollout.playing(trajectory_id):
            if error is not None:
                raise error

    await ending("done", None)
    with pytest.raises(EnvFailure):
        await ending("env", EnvFailure("the env raised"))
    with pytest.raises(ValueError):  # not a failure RollArt knows: counted as neither
        await ending("bug", ValueError("a bug"))
    assert rollout.counts["trajectories_done"] == 1 and rollout.counts["trajectories_failed"] == 1
    assert rollout.counts["env_failures"] == 1 and not rollout.live
    assert rollout.metrics()["rollart_env_host_trajectories_done"] == (ENV_HOST_COUNTS["trajectories_done"], 1)
    assert rollout.describe() == {"version": 0, **rollout.counts, "routing": {"generators": {}}}


def test_the_known_version_never_falls_and_bounds_the_weights_a_turn_may_use() -> None:
    rollout = state(alpha=2)
    train, evaluation = rollout.min_version(group()), rollout.min_version(group(4, evaluation=True))
    rollout.saw_version(1)
    assert (rollout.current_version(), train(), evaluation()) == (1, 0, 4)
    rollout.saw_version(5)
    rollout.saw_version(3)  # a late notice of an older version
    assert (rollout.current_version(), train(), evaluation()) == (5, 3, 4)
    rollout_only = state(alpha=0, train=False)  # versions are not weights: any will do
    rollout_only.saw_version(7)
    assert rollout_only.min_version(group(7, evaluation=True))() == 0


def test_a_turn_request_is_named_for_its_trajectory_and_turn() -> None:
    request = turn_request(
        "g.1", 2, [5, 6], max_tokens=8, sampling=SamplingSpec(temperature=0.5), stop_ids=[0], min_version=3, seed=9
    )
    assert (request.request_id, request.trajectory_id, request.prompt_ids) == ("g.1.t2", "g.1", [5, 6])
    assert (request.max_tokens, request.temperature, request.top_p) == (8, 0.5, 1.0)
    assert (request.stop_token_ids, request.min_version, request.seed) == ([0], 3, 9)
