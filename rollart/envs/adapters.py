"""Adapters: GEM and Gymnasium environments behind the same `Env` API.

- `gem:<id>` -> `GemEnv(id)`: `gem.make(id, **kwargs)`. GEM envs already speak text (actions in
  `\\boxed{...}`), so the adapter only normalises types. Profile: "prefill-heavy" for `game:*`
  ids, "decode-heavy" otherwise (override with `profile=`).
- `gym:<id>` -> `GymnasiumTextEnv(id)`: a Gymnasium env with a discrete action space, its
  actions named (`action_names=`, known for FrozenLake-v1, CliffWalking and Taxi; else the
  indices "0", "1", ...) and its observation drawn as text (`renderer=`; FrozenLake-v1 and Taxi
  have built-in ones that draw the player as a letter; else the env's "ansi" render with colour
  codes removed, else `str(obs)`).

Neither package is a dependency: each is imported when an adapter is built, and a missing one
is a `ConfigError` that says what to install.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from rollart.envs.base import FORMAT_PENALTY, Env, Info, Profile, StepResult, not_running, parse_choice, require
from rollart.errors import ConfigError

Renderer = Callable[[Any, Any], str]
"""(observation, env) -> text."""


def _import_optional(module: str, hint: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{module!r} is not installed ({exc}); {hint}") from exc


class GemEnv(Env):
    """A GEM environment (`gem.make(env_id)`), which already takes and returns text."""

    def __init__(
        self,
        env_id: str,
        *,
        profile: Profile | None = None,
        max_turns: int | None = None,
        system_prompt: str | None = None,
        **make_kwargs: Any,
    ) -> None:
        gem = _import_optional("gem", "install the gem extra: pip install gem-llm")
        try:
            self.env = gem.make(env_id, **make_kwargs)
        except Exception as exc:
            raise ConfigError(f"env 'gem:{env_id}': gem.make failed: {type(exc).__name__}: {exc}") from exc
        self.profile = profile or ("prefill-heavy" if env_id.startswith("game:") else "decode-heavy")
        inner_turns = getattr(self.env, "max_turns", None)
        self.max_turns = max_turns or (inner_turns if isinstance(inner_turns, int) and inner_turns > 0 else 1)
        self.system_prompt = system_prompt or "Think step by step, then give your final answer or action in \\boxed{}."

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        obs, info = self.env.reset(seed=seed)
        return str(obs), dict(info)

    def step(self, action: str) -> StepResult:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return str(obs), float(reward), bool(terminated), bool(truncated), dict(info)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def frozen_lake_text(obs: Any, env: Any) -> str:
    """Gymnasium FrozenLake's map as rows (`S F H G`), the player's cell drawn as `P`."""
    desc = env.unwrapped.desc
    ncol = len(desc[0])
    row, col = divmod(int(obs), ncol)
    rows = ["".join(c.decode() if isinstance(c, bytes) else str(c) for c in line) for line in desc]
    rows[row] = rows[row][:col] + "P" + rows[row][col + 1 :]
    return "Frozen lake (P you, S start, F ice, H hole, G goal):\n" + "\n".join(rows)


def taxi_text(obs: Any, env: Any) -> str:
    """Gymnasium Taxi's map with the taxi drawn as `T`, and where the passenger and destination are."""
    row, col, passenger, destination = tuple(env.unwrapped.decode(int(obs)))
    rows = ["".join(c.decode() if isinstance(c, bytes) else str(c) for c in line) for line in env.unwrapped.desc]
    line = rows[1 + row]
    rows[1 + row] = line[: 2 * col + 1] + "T" + line[2 * col + 2 :]
    stops = "RGYB"
    where = "in the taxi" if passenger == len(stops) else f"waiting at {stops[passenger]}"
    return "\n".join([*rows, f"T is the taxi. The passenger is {where}; the destination is {stops[destination]}."])


def _default_text(obs: Any, env: Any) -> str:
    if getattr(env, "render_mode", None) == "ansi":
        return _ANSI_ESCAPE.sub("", str(env.render())).strip("\n")
    return f"Observation: {obs}"


_KNOWN: dict[str, tuple[list[str], Renderer]] = {
    "FrozenLake-v1": (["left", "down", "right", "up"], frozen_lake_text),
    "CliffWalking-v0": (["up", "right", "down", "left"], _default_text),
    "CliffWalking-v1": (["up", "right", "down", "left"], _default_text),
    "Taxi-v3": (["south", "north", "east", "west", "pickup", "dropoff"], taxi_text),
    "Taxi-v4": (["south", "north", "east", "west", "pickup", "dropoff"], taxi_text),
}


class GymnasiumTextEnv(Env):
    """A Gymnasium env with a discrete action space, played in text."""

    def __init__(
        self,
        env_id: str,
        *,
        action_names: Sequence[str] | None = None,
        renderer: Renderer | None = None,
        max_turns: int | None = None,
        profile: Profile = "prefill-heavy",
        format_penalty: float = FORMAT_PENALTY,
        **make_kwargs: Any,
    ) -> None:
        gym = _import_optional("gymnasium", "install it: pip install gymnasium")
        known_names, known_renderer = _KNOWN.get(env_id, (None, _default_text))
        if env_id in _KNOWN and known_renderer is _default_text:
            make_kwargs.setdefault("render_mode", "ansi")
        try:
            self.env = gym.make(env_id, **make_kwargs)
        except Exception as exc:
            raise ConfigError(f"env 'gym:{env_id}': gymnasium.make failed: {type(exc).__name__}: {exc}") from exc
        n_actions: Any = getattr(self.env.action_space, "n", None)
        if n_actions is None:
            raise ConfigError(f"env 'gym:{env_id}': only discrete action spaces can be played in text")
        size = int(n_actions)
        names = [n.lower() for n in (action_names or known_names or [str(i) for i in range(size)])]
        require(len(names) == size, f"gym:{env_id}", f"{len(names)} action names for {size} actions")
        spec_turns = getattr(getattr(self.env, "spec", None), "max_episode_steps", None)
        self.env_id = env_id
        self.action_names = names
        self.renderer = renderer or known_renderer
        self.max_turns = max_turns or (spec_turns if isinstance(spec_turns, int) else 100)
        self.profile = profile
        self.format_penalty = format_penalty
        boxed = ", ".join(f"\\boxed{{{n}}}" for n in names)
        self.system_prompt = f"You are playing {env_id}, one action per turn. End your reply with one of: {boxed}."
        self._turn = 0
        self._running = False
        self._last_obs: Any = None

    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        obs, info = self.env.reset(seed=seed)
        self._turn = 0
        self._running = True
        self._last_obs = obs
        return self.renderer(obs, self.env), {**dict(info), "seed": seed, "turn": 0}

    def step(self, action: str) -> StepResult:
        if not self._running:
            raise not_running(f"gym:{self.env_id}")
        self._turn += 1
        name = parse_choice(action, self.action_names)
        if name is None:
            truncated = self._turn >= self.max_turns
            self._running = not truncated
            hint = "No valid action found. Answer with one of: " + ", ".join(self.action_names)
            text = f"{hint}\n{self.renderer(self._last_obs, self.env)}"
            return text, self.format_penalty, False, truncated, {"turn": self._turn, "format_error": True}
        obs, reward, terminated, truncated, info = self.env.step(self.action_names.index(name))
        truncated = bool(truncated) or (not terminated and self._turn >= self.max_turns)
        self._running = not (terminated or truncated)
        self._last_obs = obs
        info = {**dict(info), "turn": self._turn, "format_error": False}
        return self.renderer(obs, self.env), float(reward), bool(terminated), truncated, info

    def close(self) -> None:
        self.env.close()
