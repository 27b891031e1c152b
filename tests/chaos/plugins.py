"""A faulty reward function for fault-injection runs, loaded by the reward gateway as a user's own
module would be (`run.reward_modules: [tests.chaos.plugins]`).

`crashy-env-reward` is the env's own reward, computed slowly (`ROLLART_CHAOS_REWARD_DELAY_S`, so a
request is under way when the worker dies) by a worker that dies mid-request (`os._exit`) with
probability `ROLLART_CHAOS_REWARD_CRASH`. Each crash first appends a line to the file named by
`ROLLART_CHAOS_LOG` (workers inherit the gateway's environment), so the harness counts what was
injected, not what the system happened to notice.
"""

from __future__ import annotations

import os
import random
import time

from rollart.rewards import ScoreInput, ScoreOutput, get_reward, register_reward


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
