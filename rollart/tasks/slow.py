"""slow: an env whose calls take time drawn from a lognormal, like real stateful environments.

`make_env("slow", inner="frozen-lake", median_s=0.05, sigma=1.0)` wraps another env and makes
each `reset` and `step` block (`time.sleep`, holding its thread, as a real env would) for
`median_s * exp(sigma * N(0, 1))` seconds, capped at `cap_s`. Larger sigma means a heavier
tail: the paper's "env latency spread". Each instance draws from its own RNG (seeded by `seed`
when given), so the members of one group do not wait in lockstep.
"""

from __future__ import annotations

import random
import time
from typing import Any

from rollart.envs.base import Env, Info, StepResult, require
from rollart.envs.registry import make_env


class SlowEnv(Env):
    """Wraps an env and adds lognormal latency to every call."""

    name = "slow"

    def __init__(
        self,
        *,
        inner: str = "frozen-lake",
        median_s: float = 0.05,
        sigma: float = 1.0,
        cap_s: float = 30.0,
        seed: int | None = None,
        **inner_kwargs: Any,
    ) -> None:
        require(median_s >= 0 and sigma >= 0 and cap_s > 0, self.name, "need median_s >= 0, sigma >= 0, cap_s > 0")
        self.inner = make_env(inner, **inner_kwargs)
        self.profile = self.inner.profile
        self.max_turns = self.inner.max_turns
        self.system_prompt = self.inner.system_prompt
        self.median_s, self.sigma, self.cap_s = median_s, sigma, cap_s
        self._rng = random.Random(seed)
        self.waited_s = 0.0

    def _wait(self) -> None:
        delay = min(self.cap_s, self.median_s * self._rng.lognormvariate(0.0, self.sigma))
        self.waited_s += delay
        time.sleep(delay)

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        self._wait()
        return self.inner.reset(seed)

    def step(self, action: str) -> StepResult:
        self._wait()
        return self.inner.step(action)

    def sample_action(self, rng: random.Random) -> str | None:
        return self.inner.sample_action(rng)

    def close(self) -> None:
        self.inner.close()
