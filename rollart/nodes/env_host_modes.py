"""What an env-host does, chosen once when it starts: `StatusOnly` (the topology has no
`run.rollout`) or `RollingOut` (ask the trainer for groups, run their trajectories).

The node (`rollart.nodes.env_host.EnvHostNode`) defers its work, env opener, progress line,
policy version, busy fraction and status to its mode, instead of checking for a rollout in each.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TYPE_CHECKING, Any

import structlog

from rollart.envexec import EnvOpener, EnvWorkerPool, WorkerLimits, child_environ
from rollart.rollout.config import RolloutSpec
from rollart.workers.sandbox import worker_launch

if TYPE_CHECKING:
    from rollart.nodes.env_host import EnvHostNode

log = structlog.get_logger("rollart.env_host")


class StatusOnly:
    """The topology has no `run.rollout`: the env-host opens no env and runs no trajectory; it
    answers status (and what every node serves) until drained."""

    def opener(self, node: EnvHostNode) -> EnvOpener:
        run = node.topology.run
        return EnvOpener("auto", env_modules=run.env_modules, clock=node.clock)

    async def work(self, node: EnvHostNode) -> None:
        await asyncio.Event().wait()

    def progress(self, node: EnvHostNode) -> str:
        return ""

    def policy_version(self, node: EnvHostNode) -> int | None:
        return None

    def busy_fraction(self, node: EnvHostNode) -> float | None:
        return None

    def status(self, node: EnvHostNode) -> dict[str, Any]:
        return {}


class RollingOut:
    """`run.rollout` is set: the env-host asks the trainer for groups and runs their trajectories
    (`EnvHostNode.roll_out`) in env workers placed by `run.rollout.env_workers`."""

    def __init__(self, spec: RolloutSpec) -> None:
        self.spec = spec

    def opener(self, node: EnvHostNode) -> EnvOpener:
        run, spec = node.topology.run, self.spec.env_workers
        # The node's own credentials never reach env code, whatever their variables are called.
        environ = child_environ(os.environ, drop=(run.secret_env, run.admin_token_env), keep=spec.pass_env)
        limits = WorkerLimits(cpu_time_s=spec.cpu_time_s, memory_mb=spec.memory_mb, open_files=spec.open_files)
        python = spec.python or sys.executable
        launch = worker_launch(spec.sandbox, python=python, hide=node.secret_paths(), what="env")
        pool = EnvWorkerPool(
            processes=spec.processes, env_modules=run.env_modules, limits=limits, environ=environ, launch=launch
        )
        log.info("env_workers.launch", python=python, runs_in=launch.described)
        return EnvOpener(spec.isolation, env_modules=run.env_modules, pool=pool, clock=node.clock)

    async def work(self, node: EnvHostNode) -> None:
        await node.roll_out(self.spec)

    def progress(self, node: EnvHostNode) -> str:
        c = node.counts
        return f"trajectories {c['trajectories_done']} done, {c['trajectories_failed']} failed"

    def policy_version(self, node: EnvHostNode) -> int | None:
        return node.version

    def busy_fraction(self, node: EnvHostNode) -> float | None:
        """Trajectory slots in use now (each group slot runs up to G + R trajectories)."""
        slots = self.spec.groups_per_env_host * (self.spec.group_size + self.spec.redundancy)
        return min(1.0, len(node.running) / slots)

    def status(self, node: EnvHostNode) -> dict[str, Any]:
        return {
            "rollout": {"version": node.version, **node.counts, "routing": node.proxy.describe()},
            "envs": node.envs.status(),
        }


EnvHostMode = StatusOnly | RollingOut
