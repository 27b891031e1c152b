"""Reward functions and the elastic reward pool (Reward-as-a-Service, principle 3 of the paper).

Pure code: no network, no nodes, no protocol sessions. The reward-gateway node wraps a
`RewardPool` and answers scoring requests with it. Importing this package registers the
built-in functions (`exact-answer`, `math_verify`, `code_tests`, `env-reward`, `tiny-rm`); torch is imported only
when `tiny-rm` first runs, and the `math_verify` package (with sympy) when `math_verify` first runs.
See docs/rewards.md.
"""

from rollart.envs.answers import last_boxed
from rollart.rewards.base import (
    RewardError,
    RewardFn,
    ScoreInput,
    ScoreOutput,
    UnknownReward,
    get_reward,
    register_reward,
    registered_rewards,
    unregister_reward,
)
from rollart.rewards.functions import code_tests, env_reward, exact_answer, math_verify, tiny_rm
from rollart.rewards.pool import RewardPool
from rollart.rewards.stats import ColdStartStats, PoolStats

register_reward("exact-answer", exact_answer)
register_reward("math_verify", math_verify)
register_reward("code_tests", code_tests)
register_reward("env-reward", env_reward)
register_reward("tiny-rm", tiny_rm)

__all__ = [
    "ColdStartStats",
    "PoolStats",
    "RewardError",
    "RewardFn",
    "RewardPool",
    "ScoreInput",
    "ScoreOutput",
    "UnknownReward",
    "code_tests",
    "env_reward",
    "exact_answer",
    "get_reward",
    "last_boxed",
    "math_verify",
    "register_reward",
    "registered_rewards",
    "tiny_rm",
    "unregister_reward",
]
