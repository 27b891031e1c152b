"""flaky: an env that fails on purpose, for tests of failure isolation.

`make_env("flaky", inner="frozen-lake", reset_failure=0.2, step_failure=0.2)` wraps another env
(by name, further keyword arguments going to it; or an `Env` instance) and raises `EnvFailure`
on about that fraction of `reset` and `step` calls. With `hang_s > 0`, a fraction `hang_prob` of
calls first block for `hang_s` seconds (`time.sleep`, holding the calling thread, as a stuck
env would), to exercise timeouts.

The failures are drawn from the wrapper's own RNG, seeded from `seed` and the episode seed, so
a given (seed, episode seed, action sequence) fails at the same calls every time. `seed` defaults
to a new one for every env made in this process: failures are the machine's, not the task's, so
the trajectories of a group (one episode seed) fail independently and a group re-run after a
failure is not doomed to fail again; pass `seed` to repeat them exactly. Each call draws
the same two numbers (hang, fail) whatever the settings, so changing one rate does not reshuffle
the other's draws. A failed `step` does not reach the inner env: its state is unchanged.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

from rollart.envs.base import Env, EnvFailure, Info, StepResult, not_running, require, resolve_seed
from rollart.envs.registry import make_env

_instances = itertools.count()
"""The default `seed`: one per env made in this process."""


class FlakyEnv(Env):
    """Wraps an env and injects failures and hangs at configured rates."""

    name = "flaky"

    def __init__(
        self,
        *,
        inner: str | Env = "frozen-lake",
        reset_failure: float = 0.2,
        step_failure: float = 0.2,
        hang_s: float = 0.0,
        hang_prob: float = 0.1,
        seed: int | None = None,
        **inner_kwargs: Any,
    ) -> None:
        for label, rate in (("reset_failure", reset_failure), ("step_failure", step_failure), ("hang_prob", hang_prob)):
            require(0.0 <= rate <= 1.0, self.name, f"{label} must be in [0, 1], got {rate}")
        require(hang_s >= 0.0, self.name, f"hang_s must be >= 0, got {hang_s}")
        if isinstance(inner, Env):
            require(not inner_kwargs, self.name, "keyword arguments for the inner env need inner=<name>")
            self.inner = inner
        else:
            self.inner = make_env(inner, **inner_kwargs)
        self.profile = self.inner.profile
        self.max_turns = self.inner.max_turns
        self.system_prompt = self.inner.system_prompt
        self.reset_failure = reset_failure
        self.step_failure = step_failure
        self.hang_s = hang_s
        self.hang_prob = hang_prob
        self.seed = next(_instances) if seed is None else seed
        self._rng: random.Random | None = None

    def _maybe_fail(self, rng: random.Random, call: str, rate: float) -> None:
        hang, fail = rng.random() < self.hang_prob, rng.random() < rate
        if hang and self.hang_s > 0:
            time.sleep(self.hang_s)
        if fail:
            raise EnvFailure(f"flaky env: injected {call}() failure")

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode_seed = resolve_seed(seed)
        # A string seed is hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
        self._rng = random.Random(f"flaky:{self.seed}:{episode_seed}")
        self._maybe_fail(self._rng, "reset", self.reset_failure)
        return self.inner.reset(episode_seed)

    def step(self, action: str) -> StepResult:
        if self._rng is None:
            raise not_running(self.name)
        self._maybe_fail(self._rng, "step", self.step_failure)
        return self.inner.step(action)

    def sample_action(self, rng: random.Random) -> str | None:
        return self.inner.sample_action(rng)

    def close(self) -> None:
        self.inner.close()
