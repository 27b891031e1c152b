"""The trainer node: owns the policy version, the SampleBuffer and the task dispenser.

Env-hosts ask it for group tasks (`TaskWanted`, answered within the alpha admission limit) and
return finished groups (`GroupDone`, checked against the staleness bound) or failed ones
(`GroupFailed`, re-issued). Its loop takes a batch from the SampleBuffer as soon as one is
complete and hands it to the node's step strategy (`rollart.nodes.trainer_steps`), chosen once
from the topology: train on it (`rollout.mode: train`, sync or async schedule), record it
(`rollout-only`), or record it and model a training step on the simulation clock
(`run.sim.trainer`). Whatever the mode, the policy version changes only through `PolicyVersions`
(`rollart.rollout.versions`), which drops and aborts what a new version makes too stale.

A trainer that spans hosts is this node, the primary, and member trainer nodes that run more of its
ranks (`rollart.nodes.trainer_member`): its training engine's rank layout counts theirs
(`Topology.rank_layout`), and its ranks wait for them to join.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import structlog

from rollart.nodes.base import NodeDaemon
from rollart.nodes.learner import Learner
from rollart.nodes.trainer_rollout_only import RolloutOnlyStep, SimulatedStep
from rollart.nodes.trainer_steps import StepStrategy, TrainStep
from rollart.protocol import Session
from rollart.protocol.messages import GroupAck, GroupDone, GroupFailed, GroupTask, NoTask, PolicyVersion, TaskWanted
from rollart.rollout.buffer import SampleBuffer
from rollart.rollout.dispenser import Dispenser
from rollart.rollout.evaluation import Evaluator
from rollart.rollout.staleness import StalenessBound
from rollart.rollout.versions import PolicyVersions
from rollart.rundir import RunDir
from rollart.topology.roles import Role
from rollart.tracking.records import StepRecords
from rollart.training.registry import build_training_engine
from rollart.weights.generators import GeneratorAddress, GeneratorTargets
from rollart.weights.publisher import WeightPublisher

log = structlog.get_logger("rollart.trainer")

LEASE_CHECK_S = 5.0
TRAINER_STEP_GAUGES = {
    "reward_mean": "Mean reward of the last step's batch",
    "success_rate": "Success rate of the last step's batch",
    "loss": "Loss of the last step",
    "train_s": "Seconds the last training step took",
    "traj_per_s": "Trajectories per second over the last step",
    "stall_s": "Seconds the last step's weight export held the trainer",
    "time_wait_s": "Seconds the last step waited for its batch",
    "time_forward_s": "Seconds of forward passes in the last step (all passes)",
    "time_backward_s": "Seconds of loss and backward passes in the last step (all passes)",
    "time_optimizer_s": "Seconds of gradient clipping and optimizer steps in the last step",
    "time_push_s": "Seconds the last weight push took, first byte to the slowest generator's ack",
    "staleness_max": "Largest version lag of a token in the last batch",
    "staleness_mean": "Mean version lag of the tokens in the last batch",
    "mismatch_kl": "KL(generator || trainer) on the last batch's zero-staleness tokens (0 when both run the same)",
    "mismatch_ratio_max": "Largest trainer/generator probability ratio on the last batch's zero-staleness tokens",
    "lookahead": "Batches of work admission let start beyond the one the trainer waited for (rollout.lookahead)",
}
"""Numbers of the last step's metrics line exported as `rollart_trainer_last_<key>` gauges."""
RANK_MEMORY_GAUGES = {
    "state": "Bytes of parameters, gradients and optimizer state a training rank holds (its shards)",
    "peak": "A training rank's peak memory in the last step (GPU: allocated; CPU: resident high-water mark)",
}
"""`state_bytes_rN` and `peak_bytes_rN` of the last step, exported as `rollart_trainer_rank_<kind>_bytes{rank=N}`."""
TRAINER_GROUP_COUNTS = {
    "granted": "Groups granted to env-hosts",
    "completed": "Groups handed in",
    "reissued": "Groups run again (failed, lost or expired)",
    "abandoned": "Seeds given up after failing every try",
    "requeued": "Finished groups dropped stale from the buffer and run again",
    "buffer_accepted": "Groups the buffer accepted",
    "buffer_refused_stale": "Groups refused as too stale",
    "buffer_dropped_stale": "Buffered groups dropped as a new version made them too stale",
    "buffer_taken": "Groups taken into batches",
}
"""The dispenser's and buffer's counts exported as `rollart_trainer_groups_<key>_total`."""


class TrainerNode(NodeDaemon):
    role = Role.TRAINER

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches = 0
        self.trained_s = 0.0
        """Seconds spent in training steps (for `/status` busy)."""
        self.wait_s = 0.0
        self.untrained: list[GroupDone] = []
        """The batch taken and not yet trained on: a checkpoint keeps its groups to run again."""
        self.done = False
        self.finished = asyncio.Event()
        """Set with `done`: the last batch is taken."""
        self.closed = asyncio.Event()
        """Set once the work has closed the run after its last step (the engine and its ranks stopped)."""
        self.last_rewards: list[float] = []
        self._env_host_sessions: dict[str, str] = {}
        rollout = self.topology.run.rollout
        self.rollout = rollout
        if rollout is not None:
            bound = StalenessBound(rollout.alpha)
            self.buffer = SampleBuffer(
                batch_groups=rollout.batch_groups,
                bound=bound,
                dynamic_sampling=rollout.dynamic_sampling,
                max_uniform_batches=rollout.max_uniform_batches,
            )
            self.dispenser = Dispenser(rollout, buffered=lambda: len(self.buffer))
            self.versions = PolicyVersions(bound, self.buffer, self.dispenser, announce=self.tell_env_hosts)
        self.run_dir = RunDir(self.topology.run_dir())
        self.on_batch: Callable[[int, list[GroupDone]], None] | None = None
        """Rollout-only mode: called with (version, batch) for each batch taken, instead of recording
        it in `RunDir.rollout` (the in-process simulation reads batches this way, with no thread)."""
        self.learner: Learner | None = None
        self.records: StepRecords | None = None
        """The training steps' records (train mode); None without."""
        self.evaluator: Evaluator | None = None
        """Held-out evaluation rounds (`run.rollout.eval`, train mode); None without."""
        self.steps: StepStrategy | None = None
        if rollout is not None:
            self.steps = self._choose_steps()

    def _choose_steps(self) -> StepStrategy:
        """The node's mode, once, from the topology (see `rollart.nodes.trainer_steps`)."""
        run, rollout = self.topology.run, self.rollout
        assert rollout is not None
        if rollout.mode == "train":
            spec = run.trainer
            publisher = WeightPublisher(
                self.identity, self.secret, self.cfg, spec.weights, tls=self.tls, host=self.spec.host
            )
            addresses = [
                GeneratorAddress(peer.name, peer.host, peer.port, place=f"{peer.cluster}/{peer.host}")
                for peer in self.topology.nodes_with_role(Role.GENERATOR)
            ]
            self.learner = Learner(
                spec,
                run_dir=self.run_dir,
                targets=GeneratorTargets(publisher, addresses, self.clients, self.peer_status),
                build_engine=functools.partial(
                    build_training_engine,
                    spec,
                    run.model.path,
                    seed=rollout.seed,
                    layout=self.topology.rank_layout(self.spec.name),  # members' ranks too, if it has any
                ),
                temperature=rollout.sampling.temperature,
            )
            self.records = StepRecords(self.run_dir, peer_status=self.peer_status, tracking=run.tracking)
            if rollout.eval is not None:
                self.evaluator = Evaluator(rollout.eval, rollout.eval_tasks(), write=self.records.write)
                self.dispenser.other_work = lambda: bool(self.evaluator and self.evaluator.queue)
            return TrainStep(self, self.learner, self.records, rollout)
        if run.sim.trainer is not None:
            generators = {
                peer.name: run.sim.engines[peer.hardware]
                for peer in self.topology.nodes_with_role(Role.GENERATOR)
                if peer.hardware in run.sim.engines
            }
            return SimulatedStep(self, rollout, self.run_dir, sim=run.sim, generators=generators, clients=self.clients)
        return RolloutOnlyStep(self, rollout, self.run_dir)

    async def work(self) -> None:
        if self.steps is None:
            await super().work()
            return
        async with asyncio.TaskGroup() as tg:
            leases = tg.create_task(self._expire_leases())
            await self.steps.start(tg)
            await self._consume(self.steps)
            leases.cancel()
            await self.steps.close()
        self.closed.set()

    async def _consume(self, steps: StepStrategy) -> None:
        """Take batches as they complete and hand each to the mode's step, until the last one."""
        assert self.rollout is not None
        while self.rollout.steps is None or self.batches < self.rollout.steps:
            waiting, ready = time.perf_counter(), self.buffer.ready()
            batch = self.untrained = await self.buffer.take()
            self.wait_s = time.perf_counter() - waiting
            self.dispenser.pace(batch_was_ready=ready)
            if steps.makes_versions:
                await self.versions.foresee()
            await self.unpaused.wait()  # paused: no step starts, not even on a batch that filled meanwhile
            self.last_rewards = [t.reward for group in batch for t in group.trajectories]
            await steps.step(batch)
            if self.draining:  # no step after the drain's checkpoint; the node cancels this task
                await asyncio.Event().wait()
        await steps.finish()
        self.done = True
        self.finished.set()
        self.dispenser.finish()
        await self.versions.finish()
        log.info("trainer.done", batches=self.batches, version=self.version)

    @property
    def version(self) -> int:
        """The policy version (0 without a rollout)."""
        return self.versions.version if self.rollout is not None else 0

    async def tell_env_hosts(self, notice: PolicyVersion) -> None:
        for session in list(self.server.sessions.values()):
            if session.peer is not None and session.peer.role == Role.ENV_HOST.value and not session.finished:
                await session.send(notice)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            self.dispenser.expire()
            if self.evaluator is not None:
                self.evaluator.expire(self.dispenser.spec.group_timeout_s)

    def pause(self) -> None:
        super().pause()
        if self.rollout is not None:
            self.dispenser.pause()

    def resume(self) -> None:
        super().resume()
        if self.rollout is not None:
            self.dispenser.unpause()

    def accepts_while_draining(self, msg: Any) -> bool:
        return isinstance(msg, GroupDone | GroupFailed | TaskWanted)  # groups in flight come home

    async def on_role_request(self, session: Session, msg: Any) -> Any:
        if self.rollout is None:
            return await super().on_role_request(session, msg)
        match msg:
            case TaskWanted() if self.draining:
                return NoTask("the trainer is draining", done=True)
            case TaskWanted(env_host=env_host, wait_s=wait_s):
                if self._env_host_sessions.setdefault(env_host, session.id) != session.id:
                    self.dispenser.release_env_host(env_host, "the env-host restarted")
                    if self.evaluator is not None:
                        self.evaluator.release_env_host(env_host, "the env-host restarted")
                    self._env_host_sessions[env_host] = session.id
                task = self._eval_group(env_host)
                if task is None:
                    task = await self.dispenser.grant(env_host, lambda: self.version, wait_s=min(wait_s, 30.0))
                    task = task or self._eval_group(env_host)  # a round that started while this one waited
                if task is not None:
                    return task
                if self.done:
                    return NoTask("the run is done", done=True)
                return NoTask("paused" if self.paused else "at the alpha admission limit")
            case GroupDone(group_id=group_id) if self.evaluator is not None and self.evaluator.owns(group_id):
                self.evaluator.done(msg)
                return GroupAck(True, "evaluated")
            case GroupFailed(group_id=group_id, reason=reason) if self.evaluator is not None and self.evaluator.owns(
                group_id
            ):
                self.evaluator.lose(group_id, reason)
                return GroupAck(False, "an evaluation's group: not re-issued")
            case GroupDone(group_id=group_id):
                if group_id not in self.dispenser.leases:
                    return GroupAck(False, f"group {group_id} is not in flight (expired or re-issued)")
                accepted, why = self.buffer.put(msg, self.version)
                if accepted:
                    self.dispenser.complete(group_id)
                else:
                    self.dispenser.reissue(group_id, why)
                return GroupAck(accepted, why)
            case GroupFailed(group_id=group_id, reason=reason):
                self.dispenser.reissue(group_id, reason, failed=True)
                return GroupAck(False, "re-issued")
            case _:
                return await super().on_role_request(session, msg)

    def _eval_group(self, env_host: str) -> GroupTask | None:
        """A queued held-out evaluation group, unless paused (they come before training work, and are
        handed out while training work is held: at the end, the last round runs alone)."""
        if self.evaluator is None or self.paused or self.done:
            return None
        return self.evaluator.grant(env_host)

    async def drain_work(self) -> None:
        if self.steps is not None:
            if self.done:
                # The run is over and the launcher drains every node: let the work close it (stop the
                # ranks, which a trainer group's members wait for) rather than cancel it half way.
                await self.closed.wait()
            else:
                await self.steps.drain()
            log.info(
                "trainer.summary",
                version=self.version,
                batches=self.batches,
                **self.dispenser.stats(),
                buffer=self.buffer.stats(),
            )

    def progress(self) -> str:
        """Step and version; the launcher's terminal draws the training line from `status()["training"]`."""
        if self.rollout is None:
            return ""
        steps = self.rollout.steps if self.rollout.steps is not None else "-"
        rewards = self.last_rewards if self.learner is None else []
        mean = f", mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
        return f"{'step' if self.learner is not None else 'batch'} {self.batches}/{steps}, version {self.version}{mean}"

    def role_gauges(self) -> dict[str, tuple[str, float]]:
        last = self.records.last if self.records is not None else {}
        gauges: dict[str, tuple[str, float]] = {
            "rollart_trainer_steps": ("Steps trained (batches taken in rollout-only mode)", self.batches)
        }
        for key, doc in TRAINER_STEP_GAUGES.items():
            if isinstance(last.get(key), int | float):
                gauges[f"rollart_trainer_last_{key}"] = (doc, last[key])
        return gauges

    def role_labelled_gauges(self) -> dict[str, tuple[str, str, dict[str, float]]]:
        last = self.records.last if self.records is not None else {}
        gauges = {}
        for kind, doc in RANK_MEMORY_GAUGES.items():
            values = {key.rsplit("_r", 1)[1]: float(v) for key, v in last.items() if key.startswith(f"{kind}_bytes_r")}
            if values:
                gauges[f"rollart_trainer_rank_{kind}_bytes"] = (doc, "rank", values)
        return gauges

    def role_counters(self) -> dict[str, tuple[str, float]]:
        if self.rollout is None:
            return {}
        counts = self.dispenser.stats() | {f"buffer_{k}": v for k, v in self.buffer.stats().items()}
        counters: dict[str, tuple[str, float]] = {
            f"rollart_trainer_groups_{key}": (doc, counts[key]) for key, doc in TRAINER_GROUP_COUNTS.items()
        }
        counters["rollart_trainer_train_seconds"] = ("Seconds spent in training steps", self.trained_s)
        return counters

    def policy_version(self) -> int | None:
        return self.version if self.rollout is not None else None

    def busy_fraction(self) -> float | None:
        """Time in training steps since the node started (None when it does not train)."""
        return None if self.learner is None else min(1.0, self.trained_s / max(self.uptime_s(), 1e-9))

    def queue_depths(self) -> dict[str, int]:
        if self.rollout is None:
            return {}
        return {"buffer": len(self.buffer), "in_flight_groups": len(self.dispenser.leases)}

    def status(self) -> dict[str, Any]:
        status = super().status()
        status["done"] = self.done
        if self.rollout is not None:
            status["rollout"] = {
                "mode": self.rollout.mode,
                "version": self.version,
                "batches": self.batches,
                "steps": self.rollout.steps,
                "alpha": self.rollout.alpha,
                "buffer": self.buffer.stats(),
                "dispenser": self.dispenser.stats(),
            }
        if self.learner is not None and self.records is not None:
            status["training"] = {
                "schedule": self.rollout.schedule if self.rollout else None,
                "engine": self.learner.engine_info,
                "last_step": self.records.last,
                "baseline": self.records.baseline,
                "weights": {name: vars(stats) for name, stats in self.learner.publisher.stats().items()},
                "stall_s_max": max(self.learner.stall_s, default=0.0),
            }
        return status
