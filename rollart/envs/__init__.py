"""Environments for LLM agents: the GEM-compatible API, built-in tasks, adapters, and the runner.

Importing this package registers the built-ins:

| name | profile | what |
|---|---|---|
| `frozen-lake` | prefill-heavy | walk an N x N lake to the goal, multi-turn |
| `sokoban` | prefill-heavy | push one box onto its target, multi-turn |
| `copy-reverse` | decode-heavy | reverse a random string, one turn, partial credit |
| `flaky` | (its inner env's) | another env that fails and hangs on purpose, for tests |
| `slow` | (its inner env's) | another env whose calls take lognormal time (the latency spread sigma) |
| `sim` | as configured | a task's shape alone (turns, prompt length, success, latency, failures): simulation |
| `gem:<id>`, `gym:<id>` | (see adapters) | GEM and Gymnasium envs, if those are installed |

Pure code over plain data: nothing here knows the network, the nodes, the engines, or torch.
See `docs/envs.md`.
"""

from rollart.envs.adapters import GemEnv, GymnasiumTextEnv
from rollart.envs.base import (
    DIRECTIONS,
    FORMAT_PENALTY,
    Env,
    EnvFailure,
    Info,
    Profile,
    StepResult,
    last_boxed,
    parse_choice,
)
from rollart.envs.copy_reverse import CopyReverseEnv, position_match
from rollart.envs.flaky import FlakyEnv
from rollart.envs.frozen_lake import FrozenLakeEnv
from rollart.envs.registry import (
    EnvFactory,
    import_env_modules,
    make_env,
    register_env,
    register_env_family,
    registered_envs,
)
from rollart.envs.runner import EnvRunner
from rollart.envs.sim import SimEnv
from rollart.envs.slow import SlowEnv
from rollart.envs.sokoban import SokobanEnv

register_env("frozen-lake", FrozenLakeEnv)
register_env("sokoban", SokobanEnv)
register_env("copy-reverse", CopyReverseEnv)
register_env("flaky", FlakyEnv)
register_env("slow", SlowEnv)
register_env("sim", SimEnv)
register_env_family("gem", GemEnv)
register_env_family("gym", GymnasiumTextEnv)

__all__ = [
    "DIRECTIONS",
    "FORMAT_PENALTY",
    "CopyReverseEnv",
    "Env",
    "EnvFactory",
    "EnvFailure",
    "EnvRunner",
    "FlakyEnv",
    "FrozenLakeEnv",
    "GemEnv",
    "GymnasiumTextEnv",
    "Info",
    "Profile",
    "SimEnv",
    "SlowEnv",
    "SokobanEnv",
    "StepResult",
    "import_env_modules",
    "last_boxed",
    "make_env",
    "parse_choice",
    "position_match",
    "register_env",
    "register_env_family",
    "registered_envs",
]
