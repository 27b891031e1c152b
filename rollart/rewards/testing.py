"""Reward functions for tests of the pool: they misbehave on purpose. Not registered by default.

They live in the package (not in a test module) because the pool's workers are spawned and
import each function by module path; `rollart.rewards.testing` is importable wherever
`rollart` is. Register them under names of your choosing, or all at once:

    from rollart.rewards.testing import register_testing_rewards
    register_testing_rewards()   # "test-crash", "test-sleep", "test-raise"
"""

from __future__ import annotations

import os
import time

from rollart.rewards.base import ScoreInput, ScoreOutput, register_reward


def crash(item: ScoreInput) -> ScoreOutput:
    """Kill the worker process on the spot (exit code 3), as a segfault in native code would."""
    os._exit(3)


def sleep(item: ScoreInput) -> ScoreOutput:
    """Hold the worker for `meta["s"]` seconds, then reward 1.0: a slow reward model."""
    time.sleep(float(item.meta.get("s", 0.0)))
    return ScoreOutput(reward=1.0, details={"slept_s": item.meta.get("s", 0.0), "pid": os.getpid()})


def raise_value_error(item: ScoreInput) -> ScoreOutput:
    """A buggy reward function: raises something that is not a `RewardError`."""
    raise ValueError(f"bug in reward for task {item.task!r}")


def register_testing_rewards() -> None:
    """Register the functions above as `test-crash`, `test-sleep`, `test-raise` (idempotent)."""
    register_reward("test-crash", crash, overwrite=True)
    register_reward("test-sleep", sleep, overwrite=True)
    register_reward("test-raise", raise_value_error, overwrite=True)
