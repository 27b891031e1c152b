"""sim: a workload-shaped environment for simulation mode, with latency on the simulation clock.

It stands for a task by its shape alone: how many turns an episode takes, how long each
observation is (prompt tokens per turn; with the character tokenizer one character is one
token), and how often an episode succeeds; any reply is a valid action. Latency and failures
come from the same knobs real environments are given:

    env: sim
    env_kwargs: {turns: [3, 8], obs_tokens: 400, success: 0.5,
                 reset_s: 1.0, step_s: 0.5, sigma: 1.0, reset_failure: 0.05, step_failure: 0.02}

Each `reset` and `step` takes `median * exp(sigma * N(0, 1))` simulated seconds (capped at
`cap_s`): the env does not block its thread for it, it reports the time in `wait_s` and the
`EnvRunner` waits it out on the simulation clock (so a simulated run can go faster than real
time, or run on a virtual clock). A failing call (`reset_failure`, `step_failure`) raises
`EnvFailure` after its latency, as a real environment that times out or crashes would.

The episode (its length, observations and outcome) comes from the episode seed; latency and
failures are the machine's, not the task's, and come from a second stream seeded by the episode
seed and `noise_seed`: by default a new one for every env made in this process, so the
trajectories of a group (one task and seed) take different times and fail independently, and a
group re-run after a failure is not doomed to fail again. Pass `noise_seed` to repeat them exactly.
"""

from __future__ import annotations

import itertools
import math
import random

from rollart.envs.base import Env, EnvFailure, Info, Profile, StepResult, not_running, require, resolve_seed

_instances = itertools.count()
"""The default `noise_seed`: one per env made in this process."""


class SimEnv(Env):
    """An episode of a given shape: turns, observation length, success rate, latency, failures."""

    name = "sim"
    blocking = False

    def __init__(
        self,
        *,
        turns: int | list[int] = 4,
        obs_tokens: int = 200,
        success: float = 0.5,
        reset_s: float = 0.0,
        step_s: float = 0.0,
        sigma: float = 1.0,
        cap_s: float = 3600.0,
        reset_failure: float = 0.0,
        step_failure: float = 0.0,
        noise_seed: int | None = None,
        profile: Profile = "prefill-heavy",
    ) -> None:
        low, high = (turns, turns) if isinstance(turns, int) else tuple(turns)
        require(1 <= low <= high, self.name, f"turns must be an int >= 1 or [low, high], 1 <= low <= high; got {turns}")
        require(obs_tokens >= 1, self.name, f"obs_tokens must be >= 1, got {obs_tokens}")
        for label, rate in (("success", success), ("reset_failure", reset_failure), ("step_failure", step_failure)):
            require(0.0 <= rate <= 1.0, self.name, f"{label} must be in [0, 1], got {rate}")
        require(reset_s >= 0 and step_s >= 0 and sigma >= 0 and cap_s > 0, self.name, "latencies must be >= 0")
        self.turns = (low, high)
        self.max_turns = high
        self.obs_tokens = obs_tokens
        self.success = success
        self.reset_s, self.step_s, self.sigma, self.cap_s = reset_s, step_s, sigma, cap_s
        self.reset_failure, self.step_failure = reset_failure, step_failure
        self.noise_seed = next(_instances) if noise_seed is None else noise_seed
        self.profile = profile
        self.wait_s = 0.0
        self._rng: random.Random | None = None
        self._noise = random.Random()
        self._length = 0
        self._turn = 0

    def _latency(self, median_s: float, failure: float, call: str) -> None:
        # Both draws happen whatever the settings, so changing one knob does not reshuffle the others.
        noise, fail = self._noise.gauss(0.0, 1.0), self._noise.random()
        self.wait_s = min(self.cap_s, median_s * math.exp(self.sigma * noise))
        if fail < failure:
            raise EnvFailure(f"sim: {call}() failed (simulated, rate {failure})")

    def _observation(self, rng: random.Random) -> str:
        return "".join(rng.choices("UDLR", k=self.obs_tokens))

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        episode = resolve_seed(seed)
        self._rng = rng = random.Random(episode)
        # A string seed is hashed with SHA-512 by `random`, independent of PYTHONHASHSEED.
        self._noise = random.Random(f"sim-noise:{self.noise_seed}:{episode}")
        self._length = rng.randint(*self.turns)
        self._turn = 0
        self._latency(self.reset_s, self.reset_failure, "reset")
        return self._observation(rng), {"turns": self._length}

    def step(self, action: str) -> StepResult:
        rng, self.wait_s = self._rng, 0.0
        if rng is None or self._turn >= self._length:
            raise not_running(self.name)
        self._latency(self.step_s, self.step_failure, "step")
        self._turn += 1
        done = self._turn >= self._length
        reward = float(rng.random() < self.success) if done else 0.0
        return self._observation(rng), reward, done, False, {"success": bool(reward)} if done else {}

    def sample_action(self, rng: random.Random) -> str | None:
        return rng.choice("UDLR")
