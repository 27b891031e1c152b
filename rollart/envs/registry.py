"""Envs by name: the registry the topology's task names resolve against.

`make_env("frozen-lake", size=5)` builds a registered env. Names with a prefix, `gem:<id>` and
`gym:<id>`, go to a family factory with the id as first argument (`make_env("gym:FrozenLake-v1")`),
so any GEM or Gymnasium env can be named without registering each one.

The built-ins (`rollart.tasks`) register before the registry is first used: read or written, so a
user's env can never take a built-in's name unnoticed. A user's envs live in their own modules,
named in the topology under `run.env_modules`; `import_env_modules` imports each one, and each
registers its envs on import:

    # my_pkg/my_envs.py
    from rollart.envs import Env, register_env

    class Maze(Env): ...

    register_env("maze", Maze)

Every mistake here (unknown name, unknown keyword, a module that fails to import, a name taken
twice) is a `ConfigError` that says what was wrong and what would work.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

from rollart.envs.base import Env
from rollart.errors import ConfigError

EnvFactory = Callable[..., Env]

_envs: dict[str, EnvFactory] = {}
_families: dict[str, EnvFactory] = {}


def _with_builtins() -> None:
    """Register RollArt's own tasks as a user's env module does: by importing them (once; a later import is a
    lookup, and one from inside their own import finds them under way). Deferred to the registry's first use
    rather than done by `rollart.envs` on import, since the tasks import the env API."""
    import rollart.tasks  # noqa: F401


def _where(factory: EnvFactory) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"


def register_env(name: str, factory: EnvFactory, *, overwrite: bool = False) -> None:
    """Make `make_env(name, **kwargs)` call `factory(**kwargs)`."""
    _with_builtins()
    if not name or ":" in name or name != name.strip():
        raise ConfigError(f"env name {name!r} is invalid: it must be non-empty, without ':' or surrounding spaces")
    if name in _envs and not overwrite and _envs[name] is not factory:
        raise ConfigError(
            f"env {name!r} is already registered (by {_where(_envs[name])}); choose another name or pass overwrite=True"
        )
    _envs[name] = factory


def register_env_family(prefix: str, factory: EnvFactory, *, overwrite: bool = False) -> None:
    """Make `make_env(f"{prefix}:{id}", **kwargs)` call `factory(id, **kwargs)` (the built-ins name no family)."""
    if not prefix.isidentifier():
        raise ConfigError(f"env family prefix {prefix!r} must be an identifier")
    if prefix in _families and not overwrite and _families[prefix] is not factory:
        raise ConfigError(f"env family {prefix!r} is already registered (by {_where(_families[prefix])})")
    _families[prefix] = factory


def registered_envs() -> list[str]:
    """The registered names, sorted (family prefixes such as `gem:` are not listed)."""
    _with_builtins()
    return sorted(_envs)


def registered_factories() -> dict[str, EnvFactory]:
    """Every registered factory by name, families as `prefix:` (a copy: compare before and after imports)."""
    _with_builtins()
    return {**_envs, **{f"{prefix}:": factory for prefix, factory in _families.items()}}


@functools.lru_cache(maxsize=256)
def _signature(factory: EnvFactory) -> tuple[inspect.Signature, frozenset[str] | None] | None:
    """The factory's signature, and the names its `**kwargs: Unpack[SomeTypedDict]` takes (None: no such
    `**kwargs`); once per factory (one env is made per trajectory). None for a factory without a
    signature to read (builtins, some callables): the call will tell."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    rest = next((p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if rest is None:
        return signature, None
    try:
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory, include_extras=True)
    except (NameError, TypeError):  # an annotation that does not resolve: the keywords are not known
        return signature, None
    hint = hints.get(rest.name)
    if typing.get_origin(hint) is typing.Unpack and typing.is_typeddict(options := typing.get_args(hint)[0]):
        return signature, frozenset(options.__annotations__)
    return signature, None


def _check_kwargs(name: str, factory: EnvFactory, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    known = _signature(factory)
    if known is None:
        return
    signature, options = known
    named = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    accepted = [p.name for p in named[len(args) :]] + sorted(options or ())
    unknown = sorted(set(kwargs) - set(accepted)) if options is not None else []
    problem = f"got an unexpected keyword argument {unknown[0]!r}" if unknown else None
    if problem is None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as exc:
            problem = str(exc)
    if problem is not None:
        raise ConfigError(f"env {name!r}: {problem}; it accepts: {', '.join(accepted) or 'no arguments'}")


def unknown_env(name: str) -> str | None:
    """What is wrong with `name` as an env name now (None: it names a registered env or family).

    "unknown env 'frozen-lakes'. Did you mean 'frozen-lake'? Registered envs: ..."; the message
    `make_env` raises, and the one the topology loader reports before any env-host starts."""
    _with_builtins()
    prefix, sep, env_id = name.partition(":")
    if sep and prefix in _families:
        return None if env_id else f"env {name!r}: give an id after {prefix!r}:, e.g. {prefix}:<id>"
    if name in _envs:
        return None
    parts = [f"unknown env {name!r}."]
    close = difflib.get_close_matches(name, list(_envs), n=1)
    if close:
        parts.append(f"Did you mean {close[0]!r}?")
    parts.append(f"Registered envs: {', '.join(registered_envs()) or 'none'}")
    if _families:
        parts.append(f"(and {', '.join(f'{p}:<id>' for p in sorted(_families))})")
    return " ".join(parts)


def env_kwargs_problem(name: str, kwargs: dict[str, Any]) -> str | None:
    """What is wrong with `kwargs` for the registered env `name`, as `make_env` would say it (None: nothing
    known: they fit, or `name` is a family's or unknown, which `unknown_env` tells)."""
    _with_builtins()
    factory = _envs.get(name)
    if factory is None:
        return None
    try:
        _check_kwargs(name, factory, (), kwargs)
    except ConfigError as exc:
        return str(exc)
    return None


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the env registered as `name` (or `prefix:id`) with `kwargs`."""
    problem = unknown_env(name)
    if problem is not None:
        raise ConfigError(problem)
    prefix, sep, env_id = name.partition(":")
    if sep and prefix in _families:
        factory = _families[prefix]
        _check_kwargs(name, factory, (env_id,), kwargs)
        return factory(env_id, **kwargs)
    _check_kwargs(name, _envs[name], (), kwargs)
    return _envs[name](**kwargs)


def import_env_modules(modules: list[str]) -> None:
    """Import each module (each registers its envs on import), as `run.env_modules` asks."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            # Anything a user module raises on import is a configuration problem to report,
            # with the module named; re-raised, not swallowed.
            raise ConfigError(
                f"run.env_modules: cannot import env module {module!r}: {type(exc).__name__}: {exc}"
            ) from exc
