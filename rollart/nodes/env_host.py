"""The env-host node: runs environments and one coroutine per trajectory.

Each of its `groups_per_env_host` slots asks the trainer for a group task, runs the group's
G + R trajectories (`rollout.group`, `rollout.trajectory`), sends the first G back and asks
again. Generation calls go through the `LLMProxy` (hardware affinity, stickiness, failover);
scores come from the reward gateway. When the trainer announces a new policy version, every
trajectory started before `version - alpha` is aborted here at once. The policy version, the counts,
the trajectories in flight and the proxy are the rollout's state (`rollart.nodes.env_host_state`);
each trajectory's runner, env or agent, gets an `EpisodeContext` of it (`rollart.rollout.turns`).

Envs run where `run.rollout.env_workers` puts them (`rollart.envexec.opener`): user envs in env
worker processes, without the node's secrets and under resource limits; RollArt's own in
threads. The workers are stopped when the env-host's work ends (drain, or the run is over).

What it does is its mode (`rollart.nodes.env_host_modes`), chosen once when it starts: roll out,
or, with no `run.rollout`, only answer status. A call the trainer fails or times out is retried
with backoff (`rollart.protocol.retry`), up to `run.session.retry_deadline_s`.
"""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from typing import Any

import msgspec
import structlog

from rollart.agents.runner import AgentHost, AgentJob, run_agent_episode
from rollart.clock import SimClock
from rollart.errors import ConfigError, RollartError
from rollart.models.checkpoint import generation_eos_ids
from rollart.nodes.base import NodeDaemon
from rollart.nodes.env_host_modes import EnvHostMode, RollingOut, StatusOnly
from rollart.nodes.env_host_state import RolloutState
from rollart.protocol import ClientSession, Session
from rollart.protocol.errors import RemoteError, RequestTimeout, SessionLost, UnexpectedReply
from rollart.protocol.messages import (
    GroupDone,
    GroupFailed,
    GroupTask,
    NoTask,
    PolicyVersion,
    Score,
    TaskWanted,
    Trajectory,
)
from rollart.protocol.retry import Backoff, RetriesExhausted, retry
from rollart.rollout.barrier import TurnBarrier
from rollart.rollout.config import RolloutSpec, SamplingSpec, TaskSpec
from rollart.rollout.group import GroupDeadlines, run_group
from rollart.rollout.proxy import LLMProxy
from rollart.rollout.render import ChatRenderer
from rollart.rollout.routing.base import GeneratorRef, TaskProfiler
from rollart.rollout.staleness import StalenessBound
from rollart.rollout.trajectory import TrajectoryJob, run_trajectory
from rollart.rollout.turns import EpisodeContext
from rollart.topology.roles import REWARD_SERVICE, Role
from rollart.workers.limits import WorkerLimits, child_environ

log = structlog.get_logger("rollart.env_host")


class EnvHostNode(NodeDaemon):
    role = Role.ENV_HOST

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        run = self.topology.run
        self.rollout = run.rollout
        routing = self.rollout or RolloutSpec()  # with no rollout the proxy is never called: defaults
        self.tasks = {task.name: task for task in routing.all_tasks()}
        """Every task this env-host may be given: the training tasks and their held-out twins."""
        generators = [
            GeneratorRef(peer.name, peer.hardware, self.clients[peer.name])
            for peer in self.topology.nodes_with_role(Role.GENERATOR)
        ]
        initial = {task.name: task.profile or "decode-heavy" for task in self.tasks.values()}
        self.profiler = TaskProfiler(initial, routing.profile_ratio)
        proxy = LLMProxy(generators, self.profiler, timeout_s=routing.generate_timeout_s, routing=routing.routing)
        self.rollout_state = RolloutState(proxy, StalenessBound(routing.alpha), train=routing.mode == "train")
        """The policy version, the counts, the trajectories in flight and the proxy, in one owner."""
        self.clock = SimClock(run.sim.speedup)
        """Where simulated env latency passes (`sim` envs); real envs take real time."""
        self.mode: EnvHostMode = (
            StatusOnly(run, clock=self.clock)
            if self.rollout is None
            else RollingOut(self.rollout, self.rollout_state, run=run, hide=self.secret_paths(), clock=self.clock)
        )
        """What this env-host does, chosen once here: the node's hooks defer to it."""
        self.envs = self.mode.envs
        """Opens each task's envs where `run.rollout.env_workers` puts them; owns the env worker pool."""
        self.renderer: ChatRenderer | None = None
        self.agents: AgentHost | None = None
        """The endpoint of `env: agent` episodes and how their programs start; None without agent tasks."""
        self._slots: list[asyncio.Task[None]] = []
        self.deadlines = GroupDeadlines(routing.deadline_quantile)
        """Each task's group deadline, learned here (`rollout.min_group_size`)."""
        self.backoff = Backoff.for_retries(self.cfg)

    def _peer(self, role: Role) -> ClientSession:
        if role is Role.REWARD_GATEWAY and REWARD_SERVICE in self.clients:  # a gateway shared by runs
            return self.clients[REWARD_SERVICE]
        for peer in self.topology.nodes_with_role(role):
            if peer.name in self.clients:  # of a trainer group, only the primary (no member has sessions)
                return self.clients[peer.name]
        raise ConfigError(f"{self.topology.source}: an env-host needs a {role.value} node in the topology")

    async def work(self) -> None:
        await self.mode.work(self.roll_out)

    async def roll_out(self, spec: RolloutSpec) -> None:
        """The work of an env-host with a rollout: place the envs, then run the slots until done."""
        try:
            env_tasks = [task for task in self.tasks.values() if task.agent is None]
            traits = await self.envs.prepare({task.name: (task.env, task.env_kwargs) for task in env_tasks})
            for task in env_tasks:
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
                tokenizer = await asyncio.to_thread(_load_tokenizer, path)
            else:  # in-process: no thread (a virtual clock would run past it; other nodes import meanwhile)
                tokenizer = _load_tokenizer(path)
            self.renderer = ChatRenderer(tokenizer, stop_ids=generation_eos_ids(path))
            if len(env_tasks) < len(self.tasks):
                self.agents = await self._agent_endpoint(spec)
            trainer, reward = self._peer(Role.TRAINER), self._peer(Role.REWARD_GATEWAY)
            async with asyncio.TaskGroup() as tg:
                if spec.env_stepping == "batch":
                    self._slots = [tg.create_task(self._batch_rounds(spec, trainer, reward))]
                else:
                    slots = range(spec.groups_per_env_host)
                    self._slots = [tg.create_task(self._slot(spec, trainer, reward)) for _ in slots]
            await super().work()
        finally:  # after a drain or a cancellation, every trajectory has ended and closed its env
            await self.envs.close()  # no env worker outlives the env-host's work
            if self.agents is not None:
                await self.agents.stop()
            state = self.rollout_state
            log.info("env_host.summary", version=state.version, routing=state.proxy.describe(), **state.counts)

    async def _agent_endpoint(self, spec: RolloutSpec) -> AgentHost:
        """Serve the endpoint of this env-host's agent episodes (`env: agent` tasks); their programs run where
        env workers do, without the node's secrets and under the same limits."""
        run, workers = self.topology.run, spec.env_workers
        agents = await AgentHost.start(
            Path(run.model.path).name,
            workers.sandbox,
            hide=self.secret_paths(),
            environ=child_environ(os.environ, drop=(run.secret_env, run.admin_token_env), keep=workers.pass_env),
            limits=WorkerLimits(
                cpu_time_s=workers.cpu_time_s, memory_mb=workers.memory_mb, open_files=workers.open_files
            ),
        )
        log.info("agents.launch", runs_in=agents.launch.described, relayed=agents.launch.relay_to is not None)
        return agents

    async def _ask(
        self, spec: RolloutSpec, trainer: ClientSession, *, wait_s: float | None = None
    ) -> GroupTask | NoTask | None:
        """One group task from the trainer (waiting up to `wait_s`, by default `rollout.task_wait_s`,
        for room), its refusal, or None when the session to the trainer is gone (drained or given
        up). A trainer that times out or errs is asked again with backoff, up to `retry_deadline_s`."""
        wait_s = spec.task_wait_s if wait_s is None else wait_s
        request = TaskWanted(self.spec.name, wait_s=wait_s)
        try:
            reply = await retry(
                lambda: trainer.request(request, timeout=wait_s + self.cfg.long_poll_slack_s),
                what="task request to the trainer",
                retry_on=(RequestTimeout, RemoteError, UnexpectedReply),
                backoff=self.backoff,
                deadline_s=self.cfg.retry_deadline_s,
            )
        except SessionLost as exc:
            log.warning("env_host.no_task", error=str(exc))
            return None
        if isinstance(reply, GroupTask):
            self.rollout_state.saw_version(reply.version)
        return reply

    async def _slot(self, spec: RolloutSpec, trainer: ClientSession, reward: ClientSession) -> None:
        """Ask for a group, run it, hand it in; until the trainer says the run is done."""
        while not (self.draining or self.rollout_state.over() or trainer.finished):
            await self.unpaused.wait()
            match await self._ask(spec, trainer):
                case NoTask(done=True):
                    return
                case GroupTask() as task:
                    if self.rollout_state.over():  # granted just before the trainer said the run is over
                        return
                    if spec.max_redundancy is not None and not task.evaluation:  # adaptive redundancy
                        extras = self.deadlines.extras(task.task, task.group_size, task.redundancy, spec.max_redundancy)
                        self.rollout_state.counts["adaptive_extras"] += extras - task.redundancy
                        task = msgspec.structs.replace(task, redundancy=extras)
                    play = functools.partial(self._trajectory, spec, task, reward, None)
                    outcome = await run_group(task, play, self.deadlines)
                    if not self.rollout_state.over():
                        await self._hand_in(trainer, outcome)

    async def _batch_rounds(self, spec: RolloutSpec, trainer: ClientSession, reward: ClientSession) -> None:
        """The synchronous baseline: gather a batch of groups, step them turn by turn together."""
        done = False
        while not (done or self.draining or self.rollout_state.over() or trainer.finished):
            await self.unpaused.wait()
            tasks: list[GroupTask] = []
            while len(tasks) < spec.groups_per_env_host and not (self.draining or trainer.finished):
                # Once the batch has a group, take only what is there now: waiting for room would
                # wait for this very batch to be trained on.
                reply = await self._ask(spec, trainer, wait_s=0.0 if tasks else None)
                if isinstance(reply, GroupTask):
                    tasks.append(reply)
                elif isinstance(reply, NoTask) and (reply.done or tasks):
                    done = reply.done
                    break
            if self.rollout_state.over():
                return
            barrier = TurnBarrier()
            outcomes = await asyncio.gather(
                *(run_group(task, functools.partial(self._trajectory, spec, task, reward, barrier)) for task in tasks)
            )
            for outcome in outcomes:
                if not self.rollout_state.over():
                    await self._hand_in(trainer, outcome)

    async def _hand_in(self, trainer: ClientSession, outcome: GroupDone | GroupFailed) -> None:
        counts = self.rollout_state.counts
        if isinstance(outcome, GroupDone):
            counts["groups_done"] += 1
            counts["cancelled_extras"] += outcome.cancelled
            counts["groups_cut_at_deadline"] += outcome.cut > 0
            counts["trajectories_cut_at_deadline"] += outcome.cut
        else:
            counts["groups_failed"] += 1
        try:
            ack = await retry(
                lambda: trainer.request(outcome, timeout=self.cfg.default_request_timeout_s),
                what=f"hand-in of group {outcome.group_id}",
                retry_on=(RequestTimeout, RemoteError),
                backoff=self.backoff,
                deadline_s=self.cfg.retry_deadline_s,
            )
        except (SessionLost, RetriesExhausted, UnexpectedReply) as exc:
            counts["groups_undelivered"] += 1
            log.error("env_host.group_undelivered", group=outcome.group_id, error=str(exc))
            return
        if isinstance(outcome, GroupDone):
            counts["groups_accepted" if ack.accepted else "groups_refused"] += 1

    def _settings(self, spec: RolloutSpec, group: GroupTask, trajectory_id: str) -> tuple[TaskSpec, SamplingSpec]:
        """A trajectory's task, and how it samples: the run's way, or greedily (the first `group.greedy`)."""
        task = self.tasks.get(group.task)
        if task is None:
            raise RollartError(f"no task {group.task!r} in this env-host's topology (tasks: {sorted(self.tasks)})")
        greedy = int(trajectory_id.rsplit(".", 1)[1]) < group.greedy  # ids are `<group>.<index>` (run_group)
        return task, SamplingSpec(temperature=0.0) if greedy else spec.sampling

    async def _trajectory(
        self,
        spec: RolloutSpec,
        group: GroupTask,
        reward: ClientSession,
        barrier: TurnBarrier | None,
        trajectory_id: str,
    ) -> Trajectory:
        """Play one trajectory of `group`: an env's episode, or an agent program's (`env: agent` tasks)."""
        assert self.renderer is not None  # set by roll_out before any slot starts
        task, sampling = self._settings(spec, group, trajectory_id)
        state = self.rollout_state
        context = EpisodeContext(
            self.renderer,
            state.proxy,
            score=functools.partial(_score, reward, spec.reward_timeout_s),
            policy_version=state.current_version,
            on_start=state.on_start(trajectory_id, group),
            min_version=state.min_version(group),
        )
        with state.playing(trajectory_id):
            if task.agent is not None:
                assert self.agents is not None  # set by roll_out when a task is an agent's
                episode = AgentJob(trajectory_id, group.group_id, task, group.seed, sampling)
                return await run_agent_episode(episode, context, self.agents)
            env = await self.envs.open(task.name, timeout_s=spec.env_timeout_s)
            state.counts["envs_opened"] += 1
            try:
                job = TrajectoryJob(trajectory_id, group.group_id, task, group.seed, sampling, spec.env_timeout_s)
                return await run_trajectory(job, env, context, barrier=barrier)
            finally:
                state.counts["envs_closed"] += 1  # run_trajectory closes its env however it ends

    async def on_role_event(self, session: Session, msg: Any) -> None:
        match msg:
            case PolicyVersion(done=True):
                self.rollout_state.run_over()
            case PolicyVersion(version=version, min_start=min_start):
                self.rollout_state.saw_version(version)
                self.rollout_state.abort_stale(version, min_start)
            case _:
                await super().on_role_event(session, msg)

    async def drain_work(self) -> None:
        """Let the groups in flight finish and be handed in (the drain timeout bounds this)."""
        if self._slots:
            await asyncio.wait(self._slots)

    def progress(self) -> str:
        return self.mode.progress()

    def queue_depths(self) -> dict[str, int]:
        return {"trajectories": len(self.rollout_state.running)}

    def role_counters(self) -> dict[str, tuple[str, float]]:
        return self.rollout_state.metrics()

    def policy_version(self) -> int | None:
        return self.mode.policy_version()

    def busy_fraction(self) -> float | None:
        return self.mode.busy_fraction()

    def status(self) -> dict[str, Any]:
        return {**super().status(), **self.mode.status()}


async def _score(reward: ClientSession, timeout_s: float, request: Score) -> float:
    """A trajectory's reward from the reward gateway, within `rollout.reward_timeout_s`."""
    request = msgspec.structs.replace(request, timeout_s=timeout_s)
    return (await reward.request(request, timeout=timeout_s)).reward


@functools.cache  # one per process: the in-process simulation runs thousands of env-hosts
def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
