"""EnvHandle: an env as a trajectory drives it, async and with contained failures.

The execution package (`rollart.envexec`) gives two: `EnvRunner` (the env in a thread of the
env-host, or on its loop) and `WorkerEnvRunner` (the env in an env worker process). The trajectory
coroutine (`rollart.rollout.trajectory`) is typed against this interface only, so it neither knows
nor cares where the env runs.
"""

from __future__ import annotations

from typing import Protocol

from rollart.envs.base import Info, StepResult


class EnvHandle(Protocol):
    """An env as a trajectory drives it: `EnvRunner` (in the env-host) or `WorkerEnvRunner` (in an
    env worker process). Only `EnvFailure` and `CancelledError` come out of its calls."""

    name: str

    @property
    def max_turns(self) -> int: ...

    @property
    def system_prompt(self) -> str: ...

    async def reset(self, seed: int | None = None) -> tuple[str, Info]: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...
