"""`run.reward_pool`: how many reward worker processes the reward gateway's `RewardPool` keeps, for
how long, under which limits, which of the gateway's credentials they may see, and which other runs
share it; `run.reward_service`: a run that uses another topology's gateway instead of its own.

Part of the topology (`rollart.topology`), so it imports nothing heavy: no torch, no worker processes.
"""

from __future__ import annotations

import msgspec

from rollart.rewards.release import Release
from rollart.workers.limits import WorkerLimits
from rollart.workers.sandbox import SandboxSpec

REWARD_WORKER_LIMITS = WorkerLimits(cpu_time_s=600, memory_mb=8192, open_files=1024)
"""A reward worker's limits unless the topology says otherwise: it lives long and may hold a model."""


class RewardJobSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Another training run this reward gateway serves (a shared reward service: docs/rewards.md)."""

    name: str
    """The run's name at this gateway: its `run.reward_service.job`. Its env-hosts' sessions say it."""
    secret_env: str | None = None
    """Environment variable holding the secret that run's env-hosts prove (its `run.reward_service`'s)."""
    secret_file: str | None = None
    """Or a file holding it, relative to the topology's folder."""
    weight: float = 1.0
    """Its share of the workers when several runs want more than there is (this run's own: 1)."""


class RewardPoolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The reward gateway's elastic pool of worker processes."""

    min_workers: int = 0
    """Workers kept even when idle (0: scale to zero)."""
    max_workers: int = 2
    """Most workers at once."""
    idle_timeout_s: float = 30.0
    """A worker idle this long retires (never below min_workers)."""
    release: Release = "idle"
    """by-gap: an idle worker retires sooner, once its next request is predicted further off than a cold
    start (as measured) or the recent load would keep the others at most 0.9 busy (`rollart.rewards.release`)."""
    limits: WorkerLimits = REWARD_WORKER_LIMITS
    """Each worker's CPU seconds over its life (past half of it, it is replaced after its job), address
    space in MiB and open files, as `run.rollout.env_workers` sets them for env workers."""
    pass_env: list[str] = []
    """Environment variables passed to workers although their names look like credentials (a reward
    function's own API key); never run.secret_env or run.admin_token_env."""
    sandbox: SandboxSpec = SandboxSpec()
    """The workers' sandbox (`rollart.workers.sandbox`): namespaces of their own, no network unless it
    says so, a read-only root and a private scratch directory."""
    jobs: list[RewardJobSpec] = []
    """Other runs this gateway serves besides its own (their `run.reward_service` points here), each
    with its secret and weight; the workers are shared fairly by weight (`rollart.rewards.fair`)."""


class RewardServiceSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """A reward gateway of another topology, shared by several runs, that this run's env-hosts use
    instead of a reward-gateway node of their own (Reward-as-a-Service: docs/rewards.md)."""

    host: str = "127.0.0.1"
    """Where the shared gateway's session port is."""
    port: int
    """Its session port."""
    job: str | None = None
    """This run's name at the gateway (one of its `run.reward_pool.jobs`); None: `run.name`."""
    secret_env: str = "ROLLART_REWARD_SECRET"
    """Environment variable holding the secret the gateway knows this run by (not the run's own)."""
    secret_file: str | None = None
    """Or a file holding it, relative to the topology's folder."""
