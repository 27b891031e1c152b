"""The env-host's execution subsystem: env calls run in threads or env worker processes, with deadlines.

| module | what |
|---|---|
| `config` | `EnvWorkersSpec`, the topology's `run.rollout.env_workers` |
| `opener` | `EnvOpener`: where each task's envs run (the loop, a thread, a worker process), and opening them there |
| `runner` | `EnvRunner`: an env in a thread of the env-host (or on its loop), each call under a deadline |
| `pool` | `EnvWorkerPool`: long-lived worker processes, each hosting many envs, killed when a call hangs |
| `handles` | the pool's side of one worker (its process, its calls in flight), and starting one |
| `process_runner` | `WorkerEnvRunner`: one env in a worker process, with `EnvRunner`'s interface |
| `worker` | the worker process's side: builds envs by name and runs their calls under resource limits |
| `wire` | what the pool and its workers say to each other, in frames of `rollart.workers.framing` |

Both runners are `rollart.envs.EnvHandle`s: every failure comes out as `EnvFailure`, naming the env,
the call and the cause. Imports `rollart.envs` (the env API) and `rollart.workers` (starting worker
processes, their limits and their environment without secrets, their frames), never the nodes or
the engines. See `docs/envs.md`.
"""

from rollart.envexec.config import EnvWorkersSpec, Isolation
from rollart.envexec.opener import EnvOpener, EnvTraits, Placement, is_builtin
from rollart.envexec.pool import EnvWorkerPool
from rollart.envexec.process_runner import WorkerEnvRunner
from rollart.envexec.runner import EnvRunner
from rollart.workers.limits import WorkerLimits, child_environ

__all__ = [
    "EnvOpener",
    "EnvRunner",
    "EnvTraits",
    "EnvWorkerPool",
    "EnvWorkersSpec",
    "Isolation",
    "Placement",
    "WorkerEnvRunner",
    "WorkerLimits",
    "child_environ",
    "is_builtin",
]
