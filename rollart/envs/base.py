"""The environment API: GEM-compatible text environments for LLM agents.

An environment speaks text both ways. `reset(seed)` returns the first observation (a string
suited to a chat template's user turn) and an info dict; `step(action)` takes the model's whole
reply, parses the action it needs from it, and returns `(observation, reward, terminated,
truncated, info)`, exactly as GEM (https://github.com/axon-rl/gem) and Gymnasium do.

Each env also says how to talk to it and what it costs:
- `system_prompt`: the instructions for the model (how to format an action);
- `max_turns`: the most `step` calls an episode takes before it is truncated;
- `profile`: "prefill-heavy" (many turns, long observations, short actions) or "decode-heavy"
  (one long answer): the topology's starting guess for routing to generator hardware.

A reply without a valid action is not an error: the env answers with a small negative reward
(`FORMAT_PENALTY`), sets `info["format_error"] = True`, and the episode goes on unless a turn
limit is hit. An env that fails for real raises; `EnvRunner` turns that into `EnvFailure`.

Envs are plain blocking code: no network, no nodes, no engines, no torch. Run them through
`rollart.envexec.EnvRunner` (or an env worker process) from async code.
"""

from __future__ import annotations

import abc
import random
import re
from collections.abc import Iterable
from typing import Any, Literal

from rollart.envs.answers import last_boxed
from rollart.errors import ConfigError, RollartError

Profile = Literal["prefill-heavy", "decode-heavy"]
Info = dict[str, Any]
StepResult = tuple[str, float, bool, bool, Info]
"""`(observation, reward, terminated, truncated, info)`."""

FORMAT_PENALTY = -0.1
"""Reward for a reply in which no valid action was found."""

DIRECTIONS: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
"""Grid moves as (row, column) offsets; rows are listed top to bottom."""


class EnvFailure(RollartError):
    """An environment call raised, hung, or was made on a broken env: it fails one trajectory."""


class Env(abc.ABC):
    """A text environment (GEM's `Env` interface, plus what routing and prompting need).

    Subclasses set the three class attributes (or assign them per instance in `__init__`) and
    implement `reset` and `step`. An env is used by one trajectory at a time and need not be
    thread-safe; `EnvRunner` calls it from one worker thread.
    """

    profile: Profile = "prefill-heavy"
    """Where this env's cost lies, as a starting guess for routing (measured later)."""
    max_turns: int = 1
    """The most `step` calls of one episode; the env truncates (or terminates) by then."""
    system_prompt: str = ""
    """Instructions for the model: the task and how to format an action."""
    wait_s: float = 0.0
    """Simulated seconds the last call took, which `EnvRunner` waits out on the simulation clock
    after it returns (or raises); set by simulated envs (`sim`). A real env takes its time in the call."""
    blocking: bool = True
    """Whether calls may block (real envs: `EnvRunner` runs them in a worker thread). A simulated env
    whose calls return at once sets False and is called on the event loop."""

    @abc.abstractmethod
    def reset(self, seed: int | None = None) -> tuple[str, Info]:
        """Start an episode; the same seed gives the same episode. `None` draws a fresh seed."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the model's reply; see the module docstring for the format-error rule."""

    def sample_action(self, rng: random.Random) -> str | None:
        """A uniformly random *valid* reply for the current state: right format, random content, never
        chosen to solve anything. It measures the random-policy baseline and feeds the optional
        format warm-up (`rollart.tiny.warmup`). None: this env has no such sampler."""
        return None

    def close(self) -> None:  # noqa: B027 (a no-op default on purpose: most envs hold nothing)
        """Release what the env holds (the built-ins hold nothing)."""


def resolve_seed(seed: int | None) -> int:
    """The episode seed to use: `seed` itself, or a fresh random one (recorded in `info["seed"]`)."""
    return random.SystemRandom().randrange(2**63) if seed is None else seed


def parse_choice(text: str, choices: Iterable[str]) -> str | None:
    """Find which of `choices` (lowercase words) a reply picks, case-insensitively.

    The last complete `\\boxed{...}` (`rollart.envs.answers.last_boxed`) decides when there is one:
    its content must be a choice. Without a box, a reply that names exactly one distinct choice as
    a whole word picks it ("Left." or "I go left"); naming none or several ("up, then left") picks
    nothing.
    """
    options = {c.lower() for c in choices}
    boxed = last_boxed(text)
    if boxed is not None:
        word = boxed.strip().lower()
        return word if word in options else None
    found = {w for w in re.findall(r"[a-z0-9_]+", text.lower()) if w in options}
    return found.pop() if len(found) == 1 else None


def require(condition: bool, env: str, message: str) -> None:
    """Raise a ConfigError naming the env when a constructor argument is out of range."""
    if not condition:
        raise ConfigError(f"env {env!r}: {message}")


def not_running(env: str) -> RuntimeError:
    """The error for `step` called before `reset` or after the episode ended (a caller bug)."""
    return RuntimeError(f"{env}: step() called with no episode running; call reset() first")
