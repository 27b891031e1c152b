"""What a reward function is: its input, its output, its error, and the registry of names.

A reward function is a plain module-level callable `(ScoreInput) -> ScoreOutput`. It runs in
the reward pool's worker processes (`rollart.rewards.pool`), fresh interpreters that know nothing
the parent built at run time: the parent sends each request with the function's *name* in Python,
`module:qualname` (`reference`), and the worker imports that module (`resolve`). Hence
`register_reward` refuses lambdas and nested functions up front instead of failing in a worker.

    from rollart.rewards import ScoreInput, ScoreOutput, register_reward

    def length_penalty(item: ScoreInput) -> ScoreOutput:      # in an importable module
        return ScoreOutput(reward=-len(item.response) / 1000)

    register_reward("length-penalty", length_penalty)
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

import msgspec

from rollart.errors import ConfigError, RollartError


class ScoreInput(msgspec.Struct, frozen=True, kw_only=True):
    """One thing to score: a trajectory's final response and its size, then what the scorer may compare it to."""

    task: str
    """Name of the task the trajectory came from (e.g. `gem-math`, `frozenlake`)."""
    prompt: str
    """The prompt (or the rendered conversation) the response answers."""
    response: str
    """The policy's response text to be scored."""
    tokens: int = 0
    """The trajectory's prompt and response tokens (what a reward model's time follows; 0: unknown)."""
    answer: str | None = None
    """The reference answer, for functions that compare against one."""
    env_reward: float | None = None
    """The environment's own reward for the trajectory, for functions that pass or reshape it."""
    meta: dict[str, Any] = {}
    """Anything else a function needs (msgpack-encodable values only)."""


class ScoreOutput(msgspec.Struct):
    """A function's verdict: the scalar reward, plus details for logs and debugging."""

    reward: float
    """The scalar reward the trainer uses."""
    details: dict[str, Any] = {}
    """Why: extracted answer, format errors, model name, ... (msgpack-encodable values only)."""


class RewardError(RollartError):
    """A reward could not be computed: bad input, a failing function, or a worker that died."""


class UnknownReward(RewardError, ConfigError):
    """No reward function of that name: a config error where names are resolved, a reward error at scoring."""


RewardFn = Callable[[ScoreInput], ScoreOutput]
"""A reward function: module-level, so that worker processes can import it by reference."""

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str, fn: RewardFn, *, overwrite: bool = False) -> None:
    """Make `fn` available to the pool as `name`; `ConfigError` if taken (unless `overwrite`) or if a
    worker could not import it by its `reference`."""
    if not name or not isinstance(name, str):
        raise ConfigError(f"reward name must be a non-empty string, got {name!r}")
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: expected a callable (ScoreInput) -> ScoreOutput, got {type(fn).__name__}")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not fn:
        raise ConfigError(
            f"reward {name!r} is already registered (to {_qualified(_REGISTRY[name])}); pass overwrite=True"
        )
    try:
        same = resolve(reference(fn)) is fn
    except (ValueError, AttributeError, ImportError) as e:
        raise ConfigError(
            f"reward {name!r}: {_qualified(fn)} is not importable by reference ({e}); worker processes import "
            "reward functions by module path, so define it at module level in an importable module"
        ) from e
    if not same:
        raise ConfigError(
            f"reward {name!r}: {_qualified(fn)} is not what its module path names; define it at module level"
        )
    _REGISTRY[name] = fn


def reference(fn: object) -> str:
    """`module:qualname`, by which a worker process imports `fn` (`resolve`); `ValueError` for an
    object that has none (a callable instance) or one no import reaches (a lambda, a nested function)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ValueError(f"a {type(fn).__name__} has no module and qualified name")
    if "<" in qualname:  # <lambda>, <locals>
        raise ValueError(f"{qualname} is not reachable from its module")
    return f"{module}:{qualname}"


def resolve(ref: str) -> Any:
    """What `module:qualname` names: the module imported, then the attributes looked up
    (`ImportError`, `AttributeError` or `ValueError` if it names nothing)."""
    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"expected 'module:qualname', got {ref!r}")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def get_reward(name: str) -> RewardFn:
    """The function registered as `name`; `UnknownReward` (a `ConfigError`) naming the known ones if absent."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = registered_rewards()
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownReward(
            f"unknown reward function {name!r} (registered: {', '.join(known) or 'none'}){hint}"
        ) from None


def registered_rewards() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_REGISTRY))


def unregister_reward(name: str) -> None:
    """Forget `name` (tests and hot reloads); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def _qualified(fn: object) -> str:
    module = getattr(fn, "__module__", "?")
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"
