"""Environments for LLM agents: the GEM-compatible API, built-in tasks, adapters, and the runners.

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

Envs run in the env-host (`EnvRunner`) or in env worker processes under resource limits
(`EnvWorkerPool`, `WorkerEnvRunner`); `EnvOpener` puts each task's envs where the isolation
setting says. Pure code over plain data: nothing here knows the network, the nodes, the engines,
or torch. See `docs/envs.md`.
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
from rollart.envs.isolation import WorkerLimits, child_environ
from rollart.envs.opener import EnvOpener, EnvTraits, Isolation, Placement, is_builtin
from rollart.envs.pool import EnvWorkerPool
from rollart.envs.process_runner import WorkerEnvRunner
from rollart.envs.registry import (
    EnvFactory,
    import_env_modules,
    make_env,
    register_env,
    register_env_family,
    registered_envs,
)
from rollart.envs.runner import EnvHandle, EnvRunner
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
    "EnvHandle",
    "EnvOpener",
    "EnvRunner",
    "EnvTraits",
    "EnvWorkerPool",
    "FlakyEnv",
    "FrozenLakeEnv",
    "GemEnv",
    "GymnasiumTextEnv",
    "Info",
    "Isolation",
    "Placement",
    "Profile",
    "SimEnv",
    "SlowEnv",
    "SokobanEnv",
    "StepResult",
    "WorkerEnvRunner",
    "WorkerLimits",
    "child_environ",
    "import_env_modules",
    "is_builtin",
    "last_boxed",
    "make_env",
    "parse_choice",
    "position_match",
    "register_env",
    "register_env_family",
    "registered_envs",
]
