"""`run.reward_pool`: how many reward worker processes the reward gateway's `RewardPool` keeps, for
how long, under which limits, and which of the gateway's credentials they may see.

Part of the topology (`rollart.topology`), so it imports nothing heavy: no torch, no worker processes.
"""

from __future__ import annotations

import msgspec

from rollart.workers.limits import WorkerLimits
from rollart.workers.sandbox import SandboxSpec

REWARD_WORKER_LIMITS = WorkerLimits(cpu_time_s=600, memory_mb=8192, open_files=1024)
"""A reward worker's limits unless the topology says otherwise: it lives long and may hold a model."""


class RewardPoolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The reward gateway's elastic pool of worker processes."""

    min_workers: int = 0
    """Workers kept even when idle (0: scale to zero)."""
    max_workers: int = 2
    """Most workers at once."""
    idle_timeout_s: float = 30.0
    """A worker idle this long retires (never below min_workers)."""
    limits: WorkerLimits = REWARD_WORKER_LIMITS
    """Each worker's CPU seconds over its life (past half of it, it is replaced after its job), address
    space in MiB and open files, as `run.rollout.env_workers` sets them for env workers."""
    pass_env: list[str] = []
    """Environment variables passed to workers although their names look like credentials (a reward
    function's own API key); never run.secret_env or run.admin_token_env."""
    sandbox: SandboxSpec = SandboxSpec()
    """The workers' sandbox (`rollart.workers.sandbox`): namespaces of their own, no network unless it
    says so, a read-only root and a private scratch directory."""
