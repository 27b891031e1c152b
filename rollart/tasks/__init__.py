"""RollArt's own tasks: the envs it trains on, simulates and tests with, registered by name on import.

| name | module | profile | what |
|---|---|---|---|
| `frozen-lake` | `frozen_lake` | prefill-heavy | walk an N x N lake to the goal, multi-turn |
| `sokoban` | `sokoban` | prefill-heavy | push one box onto its target, multi-turn |
| `copy-reverse` | `copy_reverse` | decode-heavy | reverse a random string, one turn, partial credit |
| `code` | `code_exec` | decode-heavy | write a small Python function, run against hidden tests; a turn to fix it |
| `dataset` | `dataset` | decode-heavy | a row of your own JSONL or Parquet file: a prompt, one answer, checked |
| `sim` | `sim` | as configured | a task's shape alone (turns, prompt length, success, latency, failures): simulation |
| `flaky` | `flaky` | (its inner env's) | another env that fails and hangs on purpose, for tests |
| `slow` | `slow` | (its inner env's) | another env whose calls take lognormal time (the latency spread sigma) |

`grid` is the base of the two grid games. Each task is an `Env` of `rollart.envs` and nothing more:
this package registers its tasks exactly as a user's env module (`run.env_modules`) does, and
`rollart.envs` imports it so that the names resolve wherever envs are made. Plain code over plain
data, standard library only, but for `dataset`, which imports the `datasets` library when its first
env is made (see `docs/envs.md` for adding one).
"""

from rollart.envs.registry import register_env
from rollart.tasks.code_exec import CodeEnv
from rollart.tasks.copy_reverse import CopyReverseEnv, position_match
from rollart.tasks.dataset import DatasetEnv
from rollart.tasks.flaky import FlakyEnv
from rollart.tasks.frozen_lake import FrozenLakeEnv
from rollart.tasks.sim import SimEnv
from rollart.tasks.slow import SlowEnv
from rollart.tasks.sokoban import SokobanEnv

register_env("frozen-lake", FrozenLakeEnv)
register_env("sokoban", SokobanEnv)
register_env("copy-reverse", CopyReverseEnv)
register_env("code", CodeEnv)
register_env("dataset", DatasetEnv)
register_env("flaky", FlakyEnv)
register_env("slow", SlowEnv)
register_env("sim", SimEnv)

__all__ = [
    "CodeEnv",
    "CopyReverseEnv",
    "DatasetEnv",
    "FlakyEnv",
    "FrozenLakeEnv",
    "SimEnv",
    "SlowEnv",
    "SokobanEnv",
    "position_match",
]
