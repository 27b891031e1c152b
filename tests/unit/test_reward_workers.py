"""Reward worker processes: fresh interpreters on a socket pair, under limits, without the node's
secrets, whose replies are decoded as msgpack structs and never unpickled.

The functions are those of `tests/unit/worker_rewards.py`, a user's reward module that the workers
import by the functions' `module:qualname`; some of them make their worker hostile.
"""

from __future__ import annotations

import os
import pickle
import re
import resource
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.errors import ConfigError
from rollart.rewards import RewardError, RewardPool, ScoreInput, register_reward, unregister_reward
from rollart.topology import parse_topology
from rollart.workers.limits import WorkerLimits
from tests.support import ROOT
from tests.unit import worker_rewards

PID = re.compile(r"reward worker 0 \(pid (\d+)\) was killed")


def item(**meta: object) -> ScoreInput:
    return ScoreInput(task="t", prompt="p", response="r", meta=meta)


async def test_hostile_pickle_from_a_reward_worker_is_never_unpickled(tmp_path: Path) -> None:
    # The bytes are a real exploit: unpickled here, on purpose, they do plant their marker.
    planted = tmp_path / "planted-by-the-test"
    pickle.loads(worker_rewards.hostile_pickle_frame(str(planted))[4:]).close()
    assert planted.exists()
    marker = tmp_path / "unpickled-in-the-gateway"
    async with RewardPool(min_workers=1, max_workers=1) as pool:
        with pytest.raises(RewardError) as failed:
            await pool.score("test-hostile-pickle", item(marker=str(marker)), timeout=30)
        message = str(failed.value)
        assert message.startswith("reward 'test-hostile-pickle' failed: its reward worker 0 (pid ")
        assert "was killed: it sent a reply that is not valid" in message
        hostile = PID.search(message)
        assert hostile is not None
        out = await pool.score("test-pid", item(), timeout=30)  # the pool goes on, with a fresh worker
        assert out.details["pid"] != int(hostile.group(1))
        stats = pool.stats()
        assert (stats.crashed, stats.failed, stats.served, stats.cold_starts.count) == (1, 1, 1, 2)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        ("test-oversized-reply", rf"it sent a {16 * 2**20 + 1}-byte reply \(at most {16 * 2**20}\)"),
        ("test-wrong-job", r"it answered job 1000000000 while running job 0"),
        ("test-deep-reply", r"it sent a reply that is not valid: maximum recursion depth exceeded"),
    ],
)
async def test_a_reply_too_long_too_deep_or_for_another_job_fails_its_job_and_ends_the_worker(
    fn: str, why: str
) -> None:
    async with RewardPool(min_workers=1, max_workers=1) as pool:
        with pytest.raises(
            RewardError, match=rf"reward '{fn}' failed: its reward worker 0 \(pid \d+\) was killed: {why}"
        ):
            await pool.score(fn, item(), timeout=30)
        assert (await pool.score("test-pid", item(), timeout=30)).reward == 1.0
        assert (pool.stats().crashed, pool.stats().served) == (1, 1)


async def test_a_reward_worker_sees_no_secret_and_runs_under_its_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    secrets = {"ROLLART_SECRET": "s3cr3t-value", "ROLLART_ADMIN_TOKEN": "t0ken-value", "HF_TOKEN": "hf-t0ken"}
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HARMLESS_SETTING", "kept")
    limits = WorkerLimits(cpu_time_s=30, memory_mb=2048, open_files=64)
    async with RewardPool(min_workers=1, max_workers=1, limits=limits) as pool:
        # Registered after the worker started, from a module the worker had not imported.
        register_reward("test-late", worker_rewards.show_worker)
        try:
            out = await pool.score("test-late", item(), timeout=30)
        finally:
            unregister_reward("test-late")
    seen = out.details
    assert "HARMLESS_SETTING" in seen["os_environ"]
    for name, value in secrets.items():
        assert name not in seen["os_environ"]
        assert value not in seen["proc_environ"]  # not merely unset: never in the process's environment
    assert seen["limits"] == {"cpu": [30, 35], "as": [2048 * 2**20] * 2, "nofile": [64, 64]}
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] != 64  # the gateway's own are untouched


async def test_a_worker_past_half_its_cpu_seconds_is_replaced_and_a_runaway_one_killed_by_its_limit() -> None:
    async with RewardPool(min_workers=1, max_workers=1, limits=WorkerLimits(cpu_time_s=1)) as pool:
        first = await pool.score("test-spin", item(cpu_s=0.6), timeout=30)  # half of 1 s used: retired
        second = await pool.score("test-pid", item(), timeout=30)
        assert second.details["pid"] != first.details["pid"]
        assert pool.stats().crashed == 0
        with pytest.raises(RewardError, match=r"reward worker crashed \(killed by SIGXCPU \(cpu_time_s 1 exceeded\)\)"):
            await pool.score("test-spin", item(), timeout=30)
        assert (await pool.score("test-pid", item(), timeout=30)).reward == 1.0
        assert pool.stats().crashed == 1


def test_reward_workers_die_with_their_gateway_even_when_it_is_killed() -> None:
    script = (
        "import asyncio\n"
        "import tests.unit.worker_rewards\n"
        "from rollart.rewards import RewardPool, ScoreInput\n"
        "async def main():\n"
        "    async with RewardPool(min_workers=2, max_workers=2, scale_up_queue_per_worker=1) as pool:\n"
        "        item = ScoreInput(task='t', prompt='p', response='r', meta={'cpu_s': 0.05})\n"
        "        outs = await asyncio.gather(*(pool.score('test-spin', item, timeout=30) for _ in range(4)))\n"
        "        print('PIDS', *sorted({o.details['pid'] for o in outs}), flush=True)\n"
        "        await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )
    gateway = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert gateway.stdout is not None
    line = ""
    while not line.startswith("PIDS"):  # (its log lines come first)
        line = gateway.stdout.readline()
        assert line, "the gateway exited before its workers answered"
    watches = [os.pidfd_open(int(pid)) for pid in line.split()[1:]]
    gateway.kill()  # SIGKILL: no close(), no clean-up of its own
    gateway.wait()
    gateway.stdout.close()
    try:
        for fd in watches:  # a pidfd is readable once its process has exited
            assert select.select([fd], [], [], 10)[0], "a reward worker outlived its killed gateway"
    finally:
        for fd in watches:
            os.close(fd)


async def test_reward_workers_are_stopped_by_the_pool_not_by_a_stop_signal_to_the_group() -> None:
    async with RewardPool(min_workers=1, max_workers=1) as pool:
        out = await pool.score("test-pid", item(), timeout=30)
        os.kill(out.details["pid"], signal.SIGTERM)  # as a stop of the whole process group sends it
        assert (await pool.score("test-pid", item(), timeout=30)).details["pid"] == out.details["pid"]
        assert pool.stats().crashed == 0


def test_reward_worker_settings_are_read_from_the_topology_and_checked() -> None:
    nodes = "nodes:\n  - {name: reward, role: reward-gateway, port: 9901, admin_port: 9902}\n"
    pool = "{limits: {cpu_time_s: 120, memory_mb: 1024}, pass_env: [JUDGE_API_KEY]}"
    spec = parse_topology(f"run:\n  reward_pool: {pool}\n" + nodes).run.reward_pool
    assert spec.limits == WorkerLimits(cpu_time_s=120, memory_mb=1024, open_files=1024)
    assert spec.pass_env == ["JUDGE_API_KEY"]
    bad = "{limits: {cpu_time_s: 0, memory_mb: 64, open_files: 8}}"
    with pytest.raises(ConfigError) as error:
        parse_topology(f"run:\n  reward_pool: {bad}\n" + nodes)
    for key in ("cpu_time_s", "memory_mb", "open_files"):
        assert f"run.reward_pool.limits.{key}: expected an integer >=" in str(error.value)
    with pytest.raises(ConfigError, match=r"run.reward_pool.limits"):
        parse_topology("run:\n  reward_pool: {limits: {cpu_seconds: 5}}\n" + nodes)
