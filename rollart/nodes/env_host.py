"""The env-host node: runs environments and one coroutine per trajectory.

Each of its `groups_per_env_host` slots asks the trainer for a group task, runs the group's
G + R trajectories (`rollout.group`, `rollout.trajectory`), sends the first G back and asks
again. Generation calls go through the `LLMProxy` (hardware affinity, stickiness, failover);
scores come from the reward gateway. When the trainer announces a new policy version, every
trajectory started before `version - alpha` is aborted here at once.

Envs run where `run.rollout.env_workers` puts them (`rollart.envexec.opener`): user envs in env
worker processes, without the node's secrets and under resource limits; RollArt's own in
threads. The workers are stopped when the env-host's work ends (drain, or the run is over).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
from typing import Any

import structlog

from rollart.clock import SimClock
from rollart.envexec import EnvOpener, EnvWorkerPool, WorkerLimits, child_environ
from rollart.envs import EnvFailure
from rollart.errors import ConfigError, RollartError
from rollart.nodes.base import NodeDaemon
from rollart.protocol import ClientSession, Session
from rollart.protocol.errors import RemoteError, RequestTimeout, SessionLost
from rollart.protocol.messages import (
    GroupAck,
    GroupDone,
    GroupFailed,
    GroupTask,
    NoTask,
    PolicyVersion,
    Score,
    Scored,
    TaskWanted,
    Trajectory,
)
from rollart.rollout.barrier import TurnBarrier
from rollart.rollout.group import run_group
from rollart.rollout.proxy import GeneratorRef, LLMProxy, TaskProfiler
from rollart.rollout.trajectory import ChatRenderer, TrajectoryJob, run_trajectory
from rollart.topology import Role

log = structlog.get_logger("rollart.env_host")

RETRY_S = 1.0


class EnvHostNode(NodeDaemon):
    role = Role.ENV_HOST

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rollout = self.topology.run.rollout
        self.version = 0
        self.running: dict[str, tuple[asyncio.Task[Any], int]] = {}
        """Trajectories that have generated, with the version they started at (for stale aborts)."""
        self.live: dict[str, asyncio.Task[Any]] = {}
        """Every trajectory task, from before its env is made (all are cancelled when the run is done)."""
        self.run_done = False
        """The trainer said the run is over (`PolicyVersion.done`)."""
        self.counts: collections.Counter[str] = collections.Counter()
        self.renderer: ChatRenderer | None = None
        self.clock = SimClock(self.topology.run.sim.speedup)
        """Where simulated env latency passes (`sim` envs); real envs take real time."""
        self._slots: list[asyncio.Task[None]] = []
        self.envs = self._env_opener()
        """Opens each task's envs where `run.rollout.env_workers` puts them; owns the env worker pool."""
        generators = [
            GeneratorRef(peer.name, peer.hardware, self.clients[peer.name])
            for peer in self.topology.nodes_with_role(Role.GENERATOR)
        ]
        initial = {task.name: task.profile or "decode-heavy" for task in (self.rollout.tasks if self.rollout else [])}
        self.profiler = TaskProfiler(initial, self.rollout.profile_ratio if self.rollout else 16.0)
        self.proxy = LLMProxy(
            generators, self.profiler, timeout_s=self.rollout.generate_timeout_s if self.rollout else 60
        )

    def _env_opener(self) -> EnvOpener:
        run = self.topology.run
        if self.rollout is None:  # the node only answers status: it opens no env
            return EnvOpener("auto", env_modules=run.env_modules, clock=self.clock)
        spec = self.rollout.env_workers
        # The node's own credentials never reach env code, whatever their variables are called.
        environ = child_environ(os.environ, drop=(run.secret_env, run.admin_token_env), keep=spec.pass_env)
        limits = WorkerLimits(cpu_time_s=spec.cpu_time_s, memory_mb=spec.memory_mb, open_files=spec.open_files)
        pool = EnvWorkerPool(processes=spec.processes, env_modules=run.env_modules, limits=limits, environ=environ)
        return EnvOpener(spec.isolation, env_modules=run.env_modules, pool=pool, clock=self.clock)

    def over(self) -> bool:
        """Whether the trainer said the run is done (read through a call: it changes across awaits)."""
        return self.run_done

    def _peer(self, role: Role) -> ClientSession:
        for peer in self.topology.nodes_with_role(role):
            return self.clients[peer.name]
        raise ConfigError(f"{self.topology.source}: an env-host needs a {role.value} node in the topology")

    async def work(self) -> None:
        if self.rollout is None:
            await super().work()
            return
        try:
            traits = await self.envs.prepare({task.name: (task.env, task.env_kwargs) for task in self.rollout.tasks})
            for task in self.rollout.tasks:
                env = traits[task.name]
                if task.profile is None:  # the environment's own profile is the starting guess
                    self.profiler.initial[task.name] = env.profile
                if task.max_turns is not None and task.max_turns > env.max_turns:
                    log.warning(  # the environment truncates its episodes first
                        "env_host.max_turns_capped",
                        task=task.name,
                        task_max_turns=task.max_turns,
                        env_max_turns=env.max_turns,
                        hint="raise max_turns in the task's env_kwargs",
                    )
            log.info("env_host.envs_placed", placement=self.envs.status()["placement"])
            path = self.topology.run.model.path
            if self.network is None:
                self.renderer = ChatRenderer(await asyncio.to_thread(_load_tokenizer, path))
            else:  # in-process: no thread (a virtual clock would run past it; other nodes import meanwhile)
                self.renderer = ChatRenderer(_load_tokenizer(path))
            trainer, reward = self._peer(Role.TRAINER), self._peer(Role.REWARD_GATEWAY)
            async with asyncio.TaskGroup() as tg:
                if self.rollout.env_stepping == "batch":
                    self._slots = [tg.create_task(self._batch_rounds(trainer, reward))]
                else:
                    slots = range(self.rollout.groups_per_env_host)
                    self._slots = [tg.create_task(self._slot(trainer, reward)) for _ in slots]
            await super().work()
        finally:  # after a drain or a cancellation, every trajectory has ended and closed its env
            await self.envs.close()  # no env worker outlives the env-host's work
            log.info("env_host.summary", version=self.version, routing=self.proxy.describe(), **self.counts)

    async def _ask(self, trainer: ClientSession, *, wait_s: float | None = None) -> GroupTask | NoTask | None:
        """One group task from the trainer (waiting up to `wait_s`, by default `rollout.task_wait_s`,
        for room), its refusal, or None after a transient failure."""
        assert self.rollout is not None
        wait_s = self.rollout.task_wait_s if wait_s is None else wait_s
        try:
            reply = await trainer.request(TaskWanted(self.spec.name, wait_s=wait_s), timeout=wait_s + 15.0)
        except (RequestTimeout, SessionLost, RemoteError) as exc:
            log.warning("env_host.no_task", error=str(exc))
            await asyncio.sleep(RETRY_S)
            return None
        if isinstance(reply, GroupTask):
            self.version = max(self.version, reply.version)
            return reply
        return reply if isinstance(reply, NoTask) else None

    async def _slot(self, trainer: ClientSession, reward: ClientSession) -> None:
        """Ask for a group, run it, hand it in; until the trainer says the run is done."""
        while not (self.draining or self.run_done):
            await self.unpaused.wait()
            match await self._ask(trainer):
                case NoTask(done=True):
                    return
                case GroupTask() as task:
                    if self.over():  # granted just before the trainer said the run is over
                        return
                    outcome = await run_group(task, functools.partial(self._trajectory, task, reward, None))
                    if not self.run_done:
                        await self._hand_in(trainer, outcome)

    async def _batch_rounds(self, trainer: ClientSession, reward: ClientSession) -> None:
        """The synchronous baseline: gather a batch of groups, step them turn by turn together."""
        assert self.rollout is not None
        done = False
        while not (done or self.draining or self.run_done):
            await self.unpaused.wait()
            tasks: list[GroupTask] = []
            while len(tasks) < self.rollout.groups_per_env_host and not self.draining:
                # Once the batch has a group, take only what is there now: waiting for room would
                # wait for this very batch to be trained on.
                reply = await self._ask(trainer, wait_s=0.0 if tasks else None)
                if isinstance(reply, GroupTask):
                    tasks.append(reply)
                elif isinstance(reply, NoTask) and (reply.done or tasks):
                    done = reply.done
                    break
            if self.over():
                return
            barrier = TurnBarrier()
            outcomes = await asyncio.gather(
                *(run_group(task, functools.partial(self._trajectory, task, reward, barrier)) for task in tasks)
            )
            for outcome in outcomes:
                if not self.run_done:
                    await self._hand_in(trainer, outcome)

    async def _hand_in(self, trainer: ClientSession, outcome: GroupDone | GroupFailed) -> None:
        if isinstance(outcome, GroupDone):
            self.counts["groups_done"] += 1
            self.counts["cancelled_extras"] += outcome.cancelled
        else:
            self.counts["groups_failed"] += 1
        while True:
            try:
                ack = await trainer.request(outcome, timeout=30.0)
                break
            except SessionLost as exc:
                self.counts["groups_undelivered"] += 1
                log.error("env_host.group_undelivered", group=outcome.group_id, error=str(exc))
                return
            except (RequestTimeout, RemoteError) as exc:
                log.warning("env_host.hand_in_retry", group=outcome.group_id, error=str(exc))
                await asyncio.sleep(RETRY_S)
        if isinstance(ack, GroupAck) and isinstance(outcome, GroupDone):
            self.counts["groups_accepted" if ack.accepted else "groups_refused"] += 1

    async def _trajectory(
        self, group: GroupTask, reward: ClientSession, barrier: TurnBarrier | None, trajectory_id: str
    ) -> Trajectory:
        assert self.rollout is not None and self.renderer is not None
        task = next(t for t in self.rollout.tasks if t.name == group.task)
        job = TrajectoryJob(
            trajectory_id, group.group_id, task, group.seed, self.rollout.sampling, self.rollout.env_timeout_s
        )
        me = asyncio.current_task()
        assert me is not None
        self.live[trajectory_id] = me

        def started(version: int) -> None:
            self.running[trajectory_id] = (me, version)

        async def score(request: Score) -> float:
            reply = await reward.request(request, timeout=self.rollout.reward_timeout_s if self.rollout else 30.0)
            if not isinstance(reply, Scored):
                raise RemoteError("bad-response", f"reward gateway answered {type(reply).__name__}")
            return reply.reward

        # Versions only mean weights in train mode; rollout-only runs bump them with no push.
        alpha = self.rollout.alpha if self.rollout.mode == "train" else None
        try:
            env = await self.envs.open(task.name, timeout_s=job.env_timeout_s)
        except EnvFailure:  # it could not be built in its worker (the cause is named)
            self.live.pop(trajectory_id, None)
            self.counts["env_failures"] += 1
            self.counts["trajectories_failed"] += 1
            raise
        except BaseException:
            self.live.pop(trajectory_id, None)
            raise
        self.counts["envs_opened"] += 1
        try:
            result = await run_trajectory(
                job,
                env=env,
                renderer=self.renderer,
                proxy=self.proxy,
                score=score,
                policy_version=lambda: self.version,
                on_start=started,
                barrier=barrier,
                min_version=lambda: max(0, self.version - alpha) if alpha is not None else 0,
            )
        except EnvFailure:
            self.counts["env_failures"] += 1
            self.counts["trajectories_failed"] += 1
            raise
        except RollartError:
            self.counts["trajectories_failed"] += 1
            raise
        finally:
            self.running.pop(trajectory_id, None)
            self.live.pop(trajectory_id, None)
            self.counts["envs_closed"] += 1  # run_trajectory closes its env however it ends
        self.counts["trajectories_done"] += 1
        return result

    async def on_role_event(self, session: Session, msg: Any) -> None:
        match msg:
            case PolicyVersion(done=True):
                # The trainer has what it needs: what is in flight can never be used.
                self.run_done = True
                for task in list(self.live.values()):
                    task.cancel()
                log.info("env_host.run_done", aborted=len(self.live))
            case PolicyVersion(version=version, min_start=min_start):
                self.version = max(self.version, version)
                for trajectory_id, (task, started) in list(self.running.items()):
                    if started < min_start:
                        task.cancel()
                        self.counts["aborted_stale"] += 1
                        log.info("env_host.abort_stale", trajectory=trajectory_id, started=started, version=version)
            case _:
                await super().on_role_event(session, msg)

    async def drain_work(self) -> None:
        """Let the groups in flight finish and be handed in (the drain timeout bounds this)."""
        if self._slots:
            await asyncio.wait(self._slots)

    def progress(self) -> str:
        c = self.counts
        return f"trajectories {c['trajectories_done']} done, {c['trajectories_failed']} failed" if self.rollout else ""

    def queue_depths(self) -> dict[str, int]:
        return {"trajectories": len(self.running)}

    def role_counters(self) -> dict[str, tuple[str, float]]:
        return {f"rollart_env_host_{key}": (doc, self.counts[key]) for key, doc in ENV_HOST_COUNTS.items()}

    def policy_version(self) -> int | None:
        return self.version if self.rollout is not None else None

    def busy_fraction(self) -> float | None:
        """Trajectory slots in use now (each group slot runs up to G + R trajectories)."""
        if self.rollout is None:
            return None
        slots = self.rollout.groups_per_env_host * (self.rollout.group_size + self.rollout.redundancy)
        return min(1.0, len(self.running) / slots)

    def status(self) -> dict[str, Any]:
        status = super().status()
        if self.rollout is not None:
            status["rollout"] = {"version": self.version, **self.counts, "routing": self.proxy.describe()}
            status["envs"] = self.envs.status()
        return status


ENV_HOST_COUNTS = {
    "groups_done": "Groups run to the end (G trajectories reached)",
    "groups_failed": "Groups that could not reach G trajectories",
    "groups_accepted": "Groups the trainer took into its buffer",
    "groups_refused": "Groups the trainer refused (stale)",
    "groups_undelivered": "Groups that could not be handed in",
    "trajectories_done": "Trajectories finished",
    "trajectories_failed": "Trajectories that failed (environment or generation)",
    "aborted_stale": "Trajectories aborted while running: a new version made them too stale",
    "cancelled_extras": "Redundant trajectories cancelled once their group had G",
    "env_failures": "Environment resets or steps that raised or timed out",
}
"""The env-host's counts exported as metrics (`rollart_env_host_<key>_total`)."""


@functools.cache  # one per process: the in-process simulation runs thousands of env-hosts
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
