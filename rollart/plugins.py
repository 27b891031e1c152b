"""Users' own modules, named in the topology and imported where they are used.

`run.env_modules` (imported by env-hosts and env worker processes) registers environments;
`run.reward_modules` (imported by the reward gateway; its workers import a function by reference)
registers reward functions. A module that fails to import is a `ConfigError` naming the key and the
module, not a traceback from deep inside a node.
"""

from __future__ import annotations

import importlib

from rollart.errors import ConfigError


def import_modules(key: str, modules: list[str]) -> None:
    """Import each module of the topology's `key` (each registers what it provides on import)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            # Anything a user module raises on import is a configuration problem to report, with the
            # module named; re-raised, not swallowed.
            raise ConfigError(f"{key}: cannot import module {module!r}: {type(exc).__name__}: {exc}") from exc
