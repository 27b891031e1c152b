"""The `sim` environment: episodes of a configured shape, latency drawn as configured and waited
out on the simulation clock by the runner, failures at the configured rates."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from rollart.clock import SimClock, virtual_event_loop
from rollart.envexec import EnvRunner
from rollart.envs import EnvFailure, make_env
from rollart.tasks.sim import SimEnv


def episode(env: SimEnv, seed: int) -> list[tuple[str, float, bool, float]]:
    obs, _ = env.reset(seed)
    steps = [(obs, 0.0, False, env.wait_s)]
    done = False
    while not done:
        obs, reward, done, _, _ = env.step("U")
        steps.append((obs, reward, done, env.wait_s))
    return steps


def test_episodes_have_the_configured_shape_and_repeat_by_seed() -> None:
    env = make_env("sim", turns=[2, 5], obs_tokens=37, success=0.5, reset_s=1.0, step_s=0.2)
    assert isinstance(env, SimEnv) and env.max_turns == 5
    runs = [episode(env, seed) for seed in range(200)]
    assert {len(run) - 1 for run in runs} == {2, 3, 4, 5}
    assert all(len(obs) == 37 for run in runs for obs, *_ in run)
    assert episode(env, 7) == runs[7]
    rewards = [run[-1][1] for run in runs]
    assert set(rewards) == {0.0, 1.0} and 0.35 < statistics.fmean(rewards) < 0.65
    with pytest.raises(RuntimeError, match="no episode running"):
        env.step("U")


def test_a_groups_envs_share_the_episode_but_not_its_latency_or_failures() -> None:
    # A group's trajectories run one task and seed on envs of their own: the same episode, but
    # each machine's own timing and faults (else redundancy could not help, and a group that failed
    # once would fail again on every re-run of its seed).
    shape = {"turns": [2, 5], "obs_tokens": 9, "reset_s": 1.0, "step_s": 0.5, "sigma": 1.0}
    first, second = SimEnv(**shape), SimEnv(**shape)
    a, b = episode(first, 3), episode(second, 3)
    assert [step[:3] for step in a] == [step[:3] for step in b]  # observations, rewards, ends
    assert [step[3] for step in a] != [step[3] for step in b]  # latencies
    assert episode(SimEnv(**shape, noise_seed=first.noise_seed), 3) == a  # repeatable when asked

    both = 0
    for seed in range(2000):
        failed = [_reset_fails(SimEnv(reset_failure=0.2), seed) for _ in range(2)]
        both += all(failed)
    assert both / 2000 == pytest.approx(0.2 * 0.2, abs=0.015)  # independent, not 0.2 (shared)


def _reset_fails(env: SimEnv, seed: int) -> bool:
    try:
        env.reset(seed)
    except EnvFailure:
        return True
    return False


def test_latency_is_lognormal_around_the_median_and_capped() -> None:
    env = SimEnv(reset_s=2.0, sigma=1.0, cap_s=20.0)
    waits = []
    for seed in range(2000):
        env.reset(seed)
        waits.append(env.wait_s)
    assert statistics.median(waits) == pytest.approx(2.0, rel=0.1)
    assert max(waits) == 20.0 and min(waits) < 0.5  # sigma 1: a tail both ways, cut at cap_s
    exact = SimEnv(reset_s=2.0, sigma=0.0)
    exact.reset(1)
    assert exact.wait_s == 2.0


def test_failures_come_at_the_configured_rates() -> None:
    env = SimEnv(turns=10, reset_failure=0.1, step_failure=0.3)
    reset_failed = step_failed = steps = 0
    for seed in range(1000):
        try:
            env.reset(seed)
        except EnvFailure:
            reset_failed += 1
            continue
        for _ in range(10):
            steps += 1
            try:
                env.step("D")
            except EnvFailure:
                step_failed += 1
    assert reset_failed / 1000 == pytest.approx(0.1, abs=0.03)
    assert step_failed / steps == pytest.approx(0.3, abs=0.03)


@pytest.mark.parametrize("speedup", [1.0, 10.0])
def test_the_runner_waits_the_latency_out_on_the_clock(speedup: float) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        env = SimEnv(reset_s=3.0, sigma=0.0, step_s=1.0, step_failure=1.0)
        runner = EnvRunner(env, name="sim", timeout_s=60, clock=SimClock(speedup))
        start = loop.time()
        await runner.reset(1)
        assert loop.time() - start == pytest.approx(3.0 / speedup)
        with pytest.raises(EnvFailure, match="simulated"):
            await runner.step("U")
        assert loop.time() - start == pytest.approx(4.0 / speedup)  # a failure takes its time too
        await runner.close()
        # Closing takes none: `wait_s` still holds the last step's, which was waited out once (each
        # trajectory paid its last step twice, 3 s on average in fig. 12a's shape, holding its group's slot).
        assert loop.time() - start == pytest.approx(4.0 / speedup)

    with asyncio.Runner(loop_factory=virtual_event_loop) as runner:
        runner.run(scenario())
