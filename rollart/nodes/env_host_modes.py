"""What an env-host does, chosen once when it starts: `StatusOnly` (the topology has no
`run.rollout`) or `RollingOut` (ask the trainer for groups, run their trajectories).

The node (`rollart.nodes.env_host.EnvHostNode`) defers its work, progress line, policy version, busy
fraction and status to its mode, instead of checking for a rollout in each; the mode opens its envs
where `run.rollout.env_workers` puts them and reads the rollout's state (`RolloutState`), never the node.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rollart.clock import SimClock
from rollart.envexec import EnvOpener, EnvWorkerPool, WorkerLimits, child_environ
from rollart.nodes.env_host_state import RolloutState
from rollart.rollout.config import RolloutSpec
from rollart.workers.sandbox import worker_launch

if TYPE_CHECKING:
    from rollart.topology import RunSpec

log = structlog.get_logger("rollart.env_host")

RollOut = Callable[[RolloutSpec], Awaitable[None]]
"""The env-host's rollout loop (`EnvHostNode.roll_out`)."""


class StatusOnly:
    """The topology has no `run.rollout`: the env-host opens no env and runs no trajectory; it
    answers status (and what every node serves) until drained."""

    def __init__(self, run: RunSpec, *, clock: SimClock) -> None:
        self.envs = EnvOpener("auto", env_modules=run.env_modules, clock=clock)
        """An opener that is never asked for an env (there are no tasks)."""

    async def work(self, roll_out: RollOut) -> None:
        await asyncio.Event().wait()

    def progress(self) -> str:
        return ""

    def policy_version(self) -> int | None:
        return None

    def busy_fraction(self) -> float | None:
        return None

    def status(self) -> dict[str, Any]:
        return {}


class RollingOut:
    """`run.rollout` is set: the env-host asks the trainer for groups and runs their trajectories
    (`EnvHostNode.roll_out`) in env workers placed by `run.rollout.env_workers`."""

    def __init__(
        self, spec: RolloutSpec, state: RolloutState, *, run: RunSpec, hide: Sequence[Path], clock: SimClock
    ) -> None:
        """`hide`: what env workers must not see (`NodeDaemon.secret_paths`)."""
        self.spec, self.state = spec, state
        workers = spec.env_workers
        # The node's own credentials never reach env code, whatever their variables are called.
        environ = child_environ(os.environ, drop=(run.secret_env, run.admin_token_env), keep=workers.pass_env)
        limits = WorkerLimits(cpu_time_s=workers.cpu_time_s, memory_mb=workers.memory_mb, open_files=workers.open_files)
        python = workers.python or sys.executable
        launch = worker_launch(workers.sandbox, python=python, hide=hide, what="env")
        pool = EnvWorkerPool(
            processes=workers.processes, env_modules=run.env_modules, limits=limits, environ=environ, launch=launch
        )
        log.info("env_workers.launch", python=python, runs_in=launch.described)
        self.envs = EnvOpener(workers.isolation, env_modules=run.env_modules, pool=pool, clock=clock)
        """Opens each task's envs where `run.rollout.env_workers` puts them; owns the env worker pool."""

    async def work(self, roll_out: RollOut) -> None:
        # The loop stays the node's: it asks the trainer over the node's sessions and minds its drain and
        # pause. The mode only decides that it runs, and with which rollout.
        await roll_out(self.spec)

    def progress(self) -> str:
        return self.state.progress()

    def policy_version(self) -> int | None:
        return self.state.version

    def busy_fraction(self) -> float | None:
        """Trajectory slots in use now (each group slot runs up to G + R trajectories)."""
        slots = self.spec.groups_per_env_host * (self.spec.group_size + self.spec.redundancy)
        return min(1.0, len(self.state.running) / slots)

    def status(self) -> dict[str, Any]:
        return {"rollout": self.state.describe(), "envs": self.envs.status()}


EnvHostMode = StatusOnly | RollingOut
