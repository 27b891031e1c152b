"""Faulty parts for fault-injection runs, loaded as a user's own modules would be
(`run.env_modules` and `run.reward_modules: [tests.chaos.plugins]`).

`user-flaky` is `rollart.tasks.flaky` registered again by this module: a user's env, so env-hosts
run it in env worker processes (`run.rollout.env_workers.isolation: auto`), where a call that
hangs past its deadline gets its worker killed.

`crashy-env-reward` is the env's own reward, computed slowly (`ROLLART_CHAOS_REWARD_DELAY_S`, so a
request is under way when the worker dies) by a worker that dies mid-request (`os._exit`) with
probability `ROLLART_CHAOS_REWARD_CRASH`. Each crash first appends a line to the file named by
`ROLLART_CHAOS_LOG` (the harness passes the three variables to the workers by name,
`run.reward_pool.pass_env`: they see no other `ROLLART_*` variable), so the harness counts what was
injected, not what the system happened to notice.
"""

from __future__ import annotations

import os
import random
import time

from rollart.envs import register_env
from rollart.rewards import ScoreInput, ScoreOutput, get_reward, register_reward
from rollart.tasks.flaky import FlakyEnv

register_env("user-flaky", FlakyEnv)


def crashy_env_reward(item: ScoreInput) -> ScoreOutput:
    """`env-reward`, by a worker that may die in the middle of the request."""
    time.sleep(float(os.environ.get("ROLLART_CHAOS_REWARD_DELAY_S", "0.05")))
    if random.random() < float(os.environ.get("ROLLART_CHAOS_REWARD_CRASH", "0")):
        if log := os.environ.get("ROLLART_CHAOS_LOG"):
            with open(log, "a") as out:  # one write on an O_APPEND file: lines from workers do not mix
                out.write(f"{time.time():.3f} {os.getpid()} reward-crash\n")
        os._exit(13)
    return get_reward("env-reward")(item)


register_reward("crashy-env-reward", crashy_env_reward)
