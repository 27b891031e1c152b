"""The in-process simulation: every node of a topology in one process, on a virtual-time loop.

The nodes are the real daemons (`rollart.nodes`): the trainer with its dispenser, SampleBuffer and
alpha bound, env-hosts running one coroutine per trajectory through their LLMProxy, generators
serving `SimEngine`s, the reward gateway. Their persistent sessions run over a `MemoryNetwork`
(addressed by node name) instead of TCP, with the same framing limits, handshake, heartbeats and
resend buffers. The event loop's clock is virtual (`virtual_event_loop`): it jumps ahead whenever
nothing is ready, so simulated time costs only the CPU the scheduling code takes, a shape of
thousands of simulated GPUs fits on two cores, and what is measured does not depend on whether
the host keeps up (the multi-process mode's limit: docs/simulation.md).

    result = run_inprocess(load_topology("shape.yaml"))
    print(result.step_s, result.generator_busy)

Requirements: `generator.backend: sim`, `rollout.mode: rollout-only`, every task's environment
non-blocking (`env: sim`), `run.sim.speedup: 1` (the loop's clock is already simulated time), and
`run.sim.reward` set (the reward pool's worker processes would run in real time; `placement:
instant` for a rule-based reward).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import structlog

from rollart.clock import virtual_event_loop
from rollart.envs import import_env_modules, make_env
from rollart.errors import ConfigError
from rollart.generation.registry import GENERATION_BACKENDS
from rollart.generation.registry import backend as generation_backend
from rollart.logs import configure_logging
from rollart.nodes import DAEMONS, GeneratorNode, NodeDaemon, RewardGatewayNode, TrainerNode
from rollart.protocol.memory import MemoryNetwork
from rollart.protocol.messages import GroupDone
from rollart.rewards.stats import PoolStats
from rollart.topology import Topology
from rollart.topology.roles import Role


@dataclass
class Batch:
    """One batch the trainer took."""

    taken_at: float
    """Simulated seconds since the start."""
    version: int
    trajectories: int
    tokens: int
    """Prompt and response tokens of its trajectories (what a training step costs)."""
    groups: list[GroupDone]
    """The groups themselves; empty when the run was asked not to keep them (large shapes)."""


@dataclass
class InProcessRun:
    """What an in-process run did, in simulated seconds, and what it cost this machine."""

    batches: list[Batch]
    sim_s: float
    """Simulated seconds from the start until the trainer took its last batch."""
    cpu_s: float
    """CPU seconds this process spent on the run."""
    wall_s: float
    generator_busy: dict[str, float]
    """Each generator's busy fraction (busy replica-seconds per replica-second) when the run ended."""
    reward: PoolStats | None
    """The reward pool's numbers when the run ended (utilization: busy / live worker-seconds)."""
    nodes: dict[str, NodeDaemon] = field(repr=False)

    @property
    def step_s(self) -> list[float]:
        """Simulated time between consecutive batches (the first batch left out: start-up)."""
        return [b.taken_at - a.taken_at for a, b in zip(self.batches, self.batches[1:], strict=False)]

    @property
    def trajectories(self) -> int:
        return sum(batch.trajectories for batch in self.batches)


def check_inprocess(topology: Topology) -> None:
    """Raise `ConfigError` naming what keeps `topology` from running in-process."""
    run, where = topology.run, topology.source
    problems = []
    if run.rollout is None:
        problems.append("run.rollout: an in-process simulation needs a rollout section")
    elif run.rollout.mode != "rollout-only":
        problems.append("run.rollout.mode: must be rollout-only (training is simulated by run.sim.trainer)")
    if run.rollout is not None:
        import_env_modules(run.env_modules)
        for index, task in enumerate(run.rollout.tasks):
            env = make_env(task.env, **task.env_kwargs)
            if env.blocking:  # a thread would let the virtual clock run past it
                problems.append(f"run.rollout.tasks[{index}].env: {task.env} blocks; in-process needs env: sim")
            env.close()
    if not generation_backend(run.generator.backend).simulated:
        modelled = ", ".join(name for name, record in GENERATION_BACKENDS.items() if record.simulated)
        problems.append(f"run.generator.backend: must be simulated ({modelled}); got {run.generator.backend}")
    if run.sim.speedup != 1:
        problems.append(f"run.sim.speedup: must be 1 in-process (the loop's clock is simulated); got {run.sim.speedup}")
    if run.sim.reward is None and run.reward_service is None:
        problems.append(
            "run.sim.reward: needed in-process, the reward pool's worker processes run in real time "
            "(for a rule-based reward: {placement: instant})"
        )
    if sum(node.role is Role.TRAINER for node in topology.nodes) != 1:
        problems.append("nodes: an in-process simulation needs exactly one trainer")
    if problems:
        raise ConfigError(f"{where}: cannot run in-process:\n  " + "\n  ".join(problems))


GC_THRESHOLD = (100_000, 20, 10)
"""The cyclic collector's thresholds while a simulation runs (Python's defaults: 700, 10, 10)."""


def run_inprocess(
    topology: Topology,
    *,
    log: TextIO | Path | None = None,
    log_level: str = "warning",
    timeout_s: float = 1e7,
    keep_groups: bool = True,
) -> InProcessRun:
    """Run `topology` until its trainer has taken `rollout.steps` batches, then drain every node.

    `log`: where the nodes' JSON log lines go (a stream, or a file path; default stderr);
    `timeout_s`: a bound in simulated seconds; `keep_groups`: keep every batch's groups (their
    token lists take gigabytes at thousands of trajectories a batch), else only counts."""
    (done,), _ = run_inprocess_jobs(
        [topology], log=log, log_level=log_level, timeout_s=timeout_s, keep_groups=keep_groups
    )
    return done


def run_inprocess_jobs(
    topologies: Sequence[Topology],
    service: Topology | None = None,
    *,
    log: TextIO | Path | None = None,
    log_level: str = "warning",
    timeout_s: float = 1e7,
    keep_groups: bool = True,
) -> tuple[list[InProcessRun], PoolStats | None]:
    """Run several topologies at once on one virtual clock, as `run_inprocess` runs one: training
    runs sharing `service`'s reward gateway (each with `run.reward_service` at its node's host and
    port, and named in its `run.reward_pool.jobs`). Returns each run's result, in order, and the
    shared gateway's numbers when all are done (None without `service`)."""
    for topology in topologies:
        check_inprocess(topology)
    if service is not None:
        check_inprocess_service(service, topologies)
    if isinstance(log, Path):
        log.parent.mkdir(parents=True, exist_ok=True)
    previous, root = structlog.get_config(), logging.getLogger()
    handlers, level, thresholds = root.handlers[:], root.level, gc.get_threshold()
    with contextlib.ExitStack() as stack:
        stream = stack.enter_context(log.open("a")) if isinstance(log, Path) else log
        configure_logging(level=log_level, stream=stream, cache=False)  # the caller's logging comes back after
        # Every node's objects live in this one heap, and most of them as long as the run; at the
        # default thresholds the cyclic collector re-scanned them so often that it took a third of
        # the CPU at 600 env-hosts, and a growing share as the shape grew (benchmarks/paper/scale.py).
        gc.set_threshold(*GC_THRESHOLD)
        try:
            with asyncio.Runner(loop_factory=virtual_event_loop) as runner:
                return runner.run(_run_jobs(topologies, service, timeout_s, keep_groups))
        finally:
            gc.set_threshold(*thresholds)
            structlog.configure(**previous)
            root.handlers[:] = handlers
            root.setLevel(level)


def check_inprocess_service(service: Topology, jobs: Sequence[Topology]) -> None:
    """Raise `ConfigError` naming what keeps `service` from being the shared gateway of `jobs` in-process."""
    problems = []
    if [node.role for node in service.nodes] != [Role.REWARD_GATEWAY]:
        problems.append("nodes: a shared reward service in-process is one reward-gateway node")
    if service.run.sim.reward is None:
        problems.append("run.sim.reward: needed in-process (the reward pool's worker processes run in real time)")
    served = {job.name for job in service.run.reward_pool.jobs}
    gateway = service.nodes[0]
    for topology in jobs:
        wanted = topology.run.reward_service
        if wanted is None:
            problems.append(f"{topology.source}: run.reward_service is not set: it would not use the service")
            continue
        if (wanted.host, wanted.port) != (gateway.host, gateway.port):
            where = f"{gateway.host}:{gateway.port}"
            problems.append(
                f"{topology.source}: run.reward_service is {wanted.host}:{wanted.port}; the service is {where}"
            )
        if (wanted.job or topology.run.name) not in served:
            problems.append(
                f"{topology.source}: its job {wanted.job or topology.run.name!r} is not in run.reward_pool.jobs"
            )
    if problems:
        raise ConfigError(f"{service.source}: cannot serve these runs in-process:\n  " + "\n  ".join(problems))


async def _run_jobs(
    topologies: Sequence[Topology], service: Topology | None, timeout_s: float, keep_groups: bool
) -> tuple[list[InProcessRun], PoolStats | None]:
    """Run every topology in `topologies` until its trainer has taken its batches, each drained as it
    finishes; `service`: a topology whose reward gateway they share (`run.reward_service`), drained last."""
    loop = asyncio.get_running_loop()
    started_cpu, started_wall, started = time.process_time(), time.monotonic(), loop.time()
    network = MemoryNetwork(max_frame_bytes=topologies[0].run.session.max_frame_bytes)
    secret = secrets.token_bytes(32)  # every session in this process proves it, other runs' too

    def build(topology: Topology) -> dict[str, NodeDaemon]:
        return {
            spec.name: DAEMONS[spec.role](
                topology,
                spec,
                secret=secret,
                admin_token=None,
                network=network,
                other_secrets=dict.fromkeys(topology.other_sessions(spec), secret),  # in-process: all the one
            )
            for spec in topology.nodes
        }

    jobs = [build(topology) for topology in topologies]
    shared = build(service) if service is not None else {}
    batches: list[list[Batch]] = [[] for _ in jobs]
    for nodes, kept in zip(jobs, batches, strict=True):
        trainer = next(node for node in nodes.values() if isinstance(node, TrainerNode))
        trainer.on_batch = functools.partial(_record, kept, started, keep_groups)

    async def finish(nodes: dict[str, NodeDaemon], kept: list[Batch]) -> InProcessRun:
        trainer = next(node for node in nodes.values() if isinstance(node, TrainerNode))
        await trainer.finished.wait()
        sim_s = kept[-1].taken_at if kept else loop.time() - started
        busy = {
            name: node.engine.load().busy_fraction
            for name, node in nodes.items()
            if isinstance(node, GeneratorNode) and node.engine is not None
        }
        gateway = next((n for n in [*nodes.values(), *shared.values()] if isinstance(n, RewardGatewayNode)), None)
        reward = gateway.pool.stats() if gateway is not None else None
        for node in nodes.values():
            node.request_drain("the run is done")
        cpu_s, wall_s = time.process_time() - started_cpu, time.monotonic() - started_wall
        return InProcessRun(kept, sim_s, cpu_s, wall_s, busy, reward, nodes)

    async with asyncio.TaskGroup() as tg:
        for nodes in [*jobs, shared]:
            for node in nodes.values():
                context = contextvars.copy_context()  # each node's log lines name it, as in its own process
                names = {"node": node.spec.name, "role": node.role.value}
                if len(jobs) > 1 or service is not None:
                    names["job"] = node.topology.run.name
                context.run(structlog.contextvars.bind_contextvars, **names)
                tg.create_task(node.run(), context=context)
        async with asyncio.timeout(timeout_s):
            done = await asyncio.gather(*(finish(nodes, kept) for nodes, kept in zip(jobs, batches, strict=True)))
        gateway = next((node for node in shared.values() if isinstance(node, RewardGatewayNode)), None)
        service_stats = gateway.pool.stats() if gateway is not None else None
        for node in shared.values():
            node.request_drain("every run is done")
    return list(done), service_stats


def _record(kept: list[Batch], started: float, keep_groups: bool, version: int, groups: list[GroupDone]) -> None:
    """A trainer's `on_batch`: the batch it took, in `kept`."""
    trajectories = [t for group in groups for t in group.trajectories]
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    taken_at = asyncio.get_running_loop().time() - started
    kept.append(Batch(taken_at, version, len(trajectories), tokens, groups if keep_groups else []))
