"""The env API for LLM agents: the GEM-compatible `Env`, the registry of envs by name, and adapters.

| module | what |
|---|---|
| `base` | `Env` (reset/step in text), `EnvFailure`, the format-penalty rule, `parse_choice` |
| `answers` | `last_boxed`: the answer in a reply, one rule for envs and rewards |
| `programs` | `run_cases`, `judge`: a program run on test cases under limits, and graded (`code`, `code_tests`) |
| `registry` | `register_env`, `make_env`, `run.env_modules` |
| `adapters` | the `gem:<id>` and `gym:<id>` families (GEM and Gymnasium envs, if those are installed) |
| `handle` | `EnvHandle`: an env as a trajectory drives it (async, failures contained) |

RollArt's own tasks (`frozen-lake`, `sokoban`, `copy-reverse`, `code`, `dataset`, `sim`, and the
test wrappers `flaky` and `slow`) live in `rollart.tasks`, which registers them on import; the registry
imports it before its first use, so every built-in name resolves wherever envs are made.
How envs are run (threads or worker processes, with deadlines) is `rollart.envexec`, the env-host's
concern.

Pure code over plain data: nothing here knows the network, the nodes, the engines, or torch.
See `docs/envs.md`.
"""

from rollart.envs.adapters import GemEnv, GymnasiumTextEnv
from rollart.envs.answers import last_boxed
from rollart.envs.base import (
    DIRECTIONS,
    FORMAT_PENALTY,
    Env,
    EnvFailure,
    Info,
    Profile,
    StepResult,
    parse_choice,
)
from rollart.envs.handle import EnvHandle
from rollart.envs.registry import (
    EnvFactory,
    import_env_modules,
    make_env,
    register_env,
    register_env_family,
    registered_envs,
)

register_env_family("gem", GemEnv)
register_env_family("gym", GymnasiumTextEnv)

__all__ = [
    "DIRECTIONS",
    "FORMAT_PENALTY",
    "Env",
    "EnvFactory",
    "EnvFailure",
    "EnvHandle",
    "GemEnv",
    "GymnasiumTextEnv",
    "Info",
    "Profile",
    "StepResult",
    "import_env_modules",
    "last_boxed",
    "make_env",
    "parse_choice",
    "register_env",
    "register_env_family",
    "registered_envs",
]
