"""The reward gateway: Reward-as-a-Service, an elastic pool of stateless reward workers.

Env-hosts send `Score` requests naming a registered reward function; the pool
(`rollart.rewards.RewardPool`) runs them in worker processes that scale between
`run.reward_pool.min_workers` (zero allowed) and `max_workers` with the queue (or, in simulation
mode with `run.sim.reward`, a `SimRewardPool`: a modelled reward LLM on local GPUs or a service). Cold starts,
utilization and queue depth show in `/status` and `/metrics`. Bad input comes back as a
`bad-request` error saying what was wrong.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import msgspec
import structlog

from rollart.clock import SimClock
from rollart.errors import ConfigError, DeadlineExceeded
from rollart.nodes.base import NodeDaemon
from rollart.plugins import import_modules
from rollart.protocol import Session
from rollart.protocol.errors import RemoteError
from rollart.protocol.messages import Score, Scored
from rollart.rewards import RewardError, RewardPool, ScoreInput, registered_rewards
from rollart.sim.reward import SimRewardPool
from rollart.topology.roles import Role
from rollart.workers.limits import child_environ
from rollart.workers.sandbox import worker_launch

log = structlog.get_logger("rollart.reward_gateway")


JOB_GAUGES = {
    "rollart_reward_job_served": ("served", "Score requests answered, by job"),
    "rollart_reward_job_failed": ("failed", "Score requests failed, by job"),
    "rollart_reward_job_queue_depth": ("queue_depth", "Score requests waiting, by job"),
    "rollart_reward_job_busy_seconds": ("busy_s", "Worker seconds used, by job"),
    "rollart_reward_job_share": ("share", "Share of all jobs' worker seconds, by job"),
    "rollart_reward_job_wait_mean_seconds": (
        "wait_mean_s",
        "Mean queue wait of requests that reached a worker, by job",
    ),
}
"""Per-job gauges of a gateway shared by runs: metric name -> (`JobStats` field, help)."""


class RewardGatewayNode(NodeDaemon):
    role = Role.REWARD_GATEWAY

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec, sim = self.topology.run.reward_pool, self.topology.run.sim
        import_modules("run.reward_modules", self.topology.run.reward_modules)
        self.pool: RewardPool | SimRewardPool
        if sim.reward is not None:
            self.pool = SimRewardPool(sim.reward, SimClock(sim.speedup), job_weights=self.job_weights())
        else:
            run = self.topology.run
            # The node's own credentials never reach reward code, whatever their variables are called.
            environ = child_environ(os.environ, drop=(run.secret_env, run.admin_token_env), keep=spec.pass_env)
            self.pool = RewardPool(
                min_workers=spec.min_workers,
                max_workers=spec.max_workers,
                idle_timeout_s=spec.idle_timeout_s,
                release=spec.release,
                limits=spec.limits,
                environ=environ,
                launch=worker_launch(spec.sandbox, python=sys.executable, hide=self.secret_paths(), what="reward"),
                job_weights=self.job_weights(),
            )
            log.info("reward_workers.launch", runs_in=self.pool.launch.described)

    def job_weights(self) -> dict[str, float]:
        return {job.name: job.weight for job in self.topology.run.reward_pool.jobs}

    def job_of(self, session: Session) -> str:
        """The run a request came from: another run's env-host says `job/node` (checked against that
        job's secret at the handshake); this run's own nodes are this run."""
        node = session.peer.node if session.peer is not None else ""
        job, slash, _ = node.partition("/")
        return job if slash else self.topology.run.name

    async def work(self) -> None:
        async with self.pool:
            await asyncio.Event().wait()

    async def on_role_request(self, session: Session, msg: Any) -> Any:
        match msg:
            case Score():
                item = msgspec.convert(msg, ScoreInput, from_attributes=True)  # the fields Score shares, by name
                rollout = self.topology.run.rollout
                timeout = rollout.reward_timeout_s if rollout is not None else 30.0
                timeout = msg.timeout_s if msg.timeout_s > 0 else timeout  # the asking run's own deadline
                try:
                    out = await self.pool.score(msg.fn, item, timeout=timeout, job=self.job_of(session))
                except (RewardError, ConfigError) as exc:
                    raise RemoteError("bad-request", str(exc)) from exc
                except DeadlineExceeded as exc:
                    raise RemoteError("timeout", str(exc)) from exc
                return Scored(out.reward, out.details)
            case _:
                return await super().on_role_request(session, msg)

    def progress(self) -> str:
        stats = self.pool.stats()
        return f"workers {stats.live_workers}, served {stats.served}"

    def queue_depths(self) -> dict[str, int]:
        return {"reward_queue": self.pool.stats().queue_depth}

    def busy_fraction(self) -> float | None:
        """Busy worker-seconds per live worker-second."""
        return self.pool.stats().utilization

    def role_gauges(self) -> dict[str, tuple[str, float]]:
        stats = self.pool.stats()
        return {
            "rollart_reward_workers": ("Live reward worker processes", stats.live_workers),
            "rollart_reward_workers_busy": ("Reward workers running a job", stats.busy_workers),
            "rollart_reward_queue_depth": ("Score requests waiting for a worker", stats.queue_depth),
            "rollart_reward_utilization": ("Busy worker-seconds per live worker-second", stats.utilization),
            "rollart_reward_cold_starts": ("Reward workers started", stats.cold_starts.count),
            "rollart_reward_cold_start_last_seconds": (
                "Spawn-to-ready time of the last worker",
                stats.cold_starts.last_s,
            ),
            "rollart_reward_served": ("Score requests answered", stats.served),
            "rollart_reward_failed": ("Score requests that failed", stats.failed),
        }

    def role_labelled_gauges(self) -> dict[str, tuple[str, str, dict[str, float]]]:
        jobs = self.pool.stats().jobs
        return {
            name: (doc, "job", {job: getattr(numbers, field) for job, numbers in jobs.items()})
            for name, (field, doc) in JOB_GAUGES.items()
        }

    def status(self) -> dict[str, Any]:
        status = super().status()
        status["reward_pool"] = msgspec.to_builtins(self.pool.stats()) | {"functions": registered_rewards()}
        if isinstance(self.pool, RewardPool):
            status["reward_pool"]["runs_in"] = self.pool.launch.described
        return status
