"""Faulty parts for fault-injection runs, loaded as a user's own modules would be
(`run.env_modules` and `run.reward_modules: [tests.chaos.plugins]`).

`user-flaky` is `rollart.tasks.flaky` registered again by this module: a user's env, so env-hosts
run it in env worker processes (`run.rollout.env_workers.isolation: auto`), where a call that
hangs past its deadline gets its worker killed.

`crashy-env-reward` is the env's own reward, computed slowly (`ROLLART_CHAOS_REWARD_DELAY_S`, so a
request is under way when the worker dies) by a worker that dies mid-request (`os._exit`) with
probability `ROLLART_CHAOS_REWARD_CRASH` (the harness passes the variables to the workers by name,
`run.reward_pool.pass_env`: they see no other `ROLLART_*` variable). Each crash exits with
`REWARD_CRASH_EXIT`, a code nothing else ends a worker with, so the harness counts the injected
crashes from the gateway's log of its workers' exits (a sandboxed worker can write nowhere else the
harness reads).
"""

from __future__ import annotations

import os
import random
import time

from rollart.envs import register_env
from rollart.rewards import ScoreInput, ScoreOutput, get_reward, register_reward
from rollart.tasks.flaky import FlakyEnv
from rollart.testkit.harness import REWARD_CRASH_EXIT

register_env("user-flaky", FlakyEnv)


def crashy_env_reward(item: ScoreInput) -> ScoreOutput:
    """`env-reward`, by a worker that may die in the middle of the request."""
    time.sleep(float(os.environ.get("ROLLART_CHAOS_REWARD_DELAY_S", "0.05")))
    if random.random() < float(os.environ.get("ROLLART_CHAOS_REWARD_CRASH", "0")):
        os._exit(REWARD_CRASH_EXIT)
    return get_reward("env-reward")(item)


register_reward("crashy-env-reward", crashy_env_reward)
