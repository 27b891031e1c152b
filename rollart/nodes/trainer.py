"""The trainer node: owns the policy version, the SampleBuffer and the task dispenser.

Env-hosts ask it for group tasks (`TaskWanted`, answered within the alpha admission limit) and
return finished groups (`GroupDone`, checked against the staleness bound) or failed ones
(`GroupFailed`, re-issued). Its loop takes a batch from the SampleBuffer as soon as one is
complete. In `train` mode it trains on it (`Learner`: GRPO step, weight push that the trainer
never waits for, metrics, checkpoints), bumps the policy version and goes on; with
`schedule: sync` it instead holds the dispenser while it trains and until every generator has
loaded the new weights (the synchronous baseline). In `rollout-only` mode it does not train: it
records each batch to the run folder's `RunDir.rollout` and, when asked to, counts the batch as a new policy
version, which drops and aborts whatever that version makes too stale, exactly as training would;
in simulation mode with `run.sim.trainer`, each batch also costs a modelled training step (and for
the sync schedule the weight push), on the simulation clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from rollart.clock import SimClock
from rollart.errors import RollartError
from rollart.nodes.base import NodeDaemon
from rollart.nodes.learner import Learner
from rollart.protocol import Session
from rollart.protocol.messages import (
    GroupAck,
    GroupDone,
    GroupFailed,
    NoTask,
    PolicyVersion,
    SimWeights,
    TaskWanted,
)
from rollart.rollout.buffer import SampleBuffer
from rollart.rollout.dispenser import Dispenser
from rollart.rundir import JsonlLog, RunDir
from rollart.topology import Role

log = structlog.get_logger("rollart.trainer")

LEASE_CHECK_S = 5.0
SYNC_PUSH_TIMEOUT_S = 600.0
"""The synchronous baseline waits this long for every generator to load a version, then goes on."""
FINAL_PUSH_S = 30.0
"""At the end of a run, how long the trainer waits for generators to load the last version."""
TRAINER_STEP_GAUGES = {
    "reward_mean": "Mean reward of the last step's batch",
    "success_rate": "Success rate of the last step's batch",
    "loss": "Loss of the last step",
    "train_s": "Seconds the last training step took",
    "traj_per_s": "Trajectories per second over the last step",
    "stall_s": "Seconds the last step waited for its batch",
    "staleness_max": "Largest version lag of a token in the last batch",
    "staleness_mean": "Mean version lag of the tokens in the last batch",
}
"""Numbers of the last step's metrics line exported as `rollart_trainer_last_<key>` gauges."""
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
        self.version = 0
        self.batches = 0
        self.trained_s = 0.0
        """Seconds spent in training steps (for `/status` busy)."""
        self.done = False
        self.finished = asyncio.Event()
        """Set with `done`: the last batch is taken."""
        self.last_rewards: list[float] = []
        self._env_host_sessions: dict[str, str] = {}
        rollout = self.topology.run.rollout
        self.rollout = rollout
        if rollout is not None:
            self.buffer = SampleBuffer(
                batch_groups=rollout.batch_groups,
                alpha=rollout.alpha,
                dynamic_sampling=rollout.dynamic_sampling,
                max_uniform_batches=rollout.max_uniform_batches,
            )
            self.dispenser = Dispenser(rollout, buffered=lambda: len(self.buffer))
        self.run_dir = RunDir(self.topology.run_dir())
        self.learner = Learner(self) if rollout is not None and rollout.mode == "train" else None
        self.last_checkpoint_step = 0
        self.clock = SimClock(self.topology.run.sim.speedup)
        """Simulation mode's clock (`run.sim.trainer`)."""
        self._step_lock = asyncio.Lock()
        """Held by a training step and by a checkpoint, so a drain's checkpoint never sees half a step."""
        self._background: set[asyncio.Future[None]] = set()
        """Simulated asynchronous weight pushes in flight."""
        self.on_batch: Callable[[int, list[GroupDone]], None] | None = None
        """Rollout-only mode: called with (version, batch) for each batch taken, instead of appending
        it to `RunDir.rollout` (the in-process simulation reads batches this way, with no thread)."""

    async def work(self) -> None:
        if self.rollout is None:
            await super().work()
            return
        async with asyncio.TaskGroup() as tg:
            leases = tg.create_task(self._expire_leases())
            if self.learner is not None:
                self.dispenser.held = True  # nothing starts before the weights are ready
                state = await self.learner.start()
                tg.create_task(self.learner.publisher.run())
                held = await self.learner.connect_generators()
                if state is not None:
                    self._resume(state)
                claimed = await asyncio.to_thread(self.learner.claim_incarnation)
                self.dispenser.incarnation = max(self.dispenser.incarnation, claimed)
                await self._bring_generators_in_line(held)
                self.dispenser.held = False
                self.dispenser.changed()
            await self._consume()
            leases.cancel()
            if self.learner is not None:
                with contextlib.suppress(TimeoutError):  # let the last version land, within reason
                    await self.learner.publisher.wait_delivered(self.version, timeout=FINAL_PUSH_S)
                await self.learner.publisher.close()

    def _resume(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: same step and version, the same groups still to run."""
        self.version = int(state["version"])
        self.batches = self.last_checkpoint_step = int(state["step"])
        self.dispenser.load_state(state["dispenser"])

    async def _bring_generators_in_line(self, held: int) -> None:
        """Before any group starts, every generator must run this trainer's weights.

        A generator may hold a version this trainer never saved (pushed by the run it resumes, after
        its last checkpoint) or never had (no checkpoint at all). Rolling versions back would let two
        different weights share a number, so the trainer gives its weights a fresh version above
        every generator's instead; versions only ever increase."""
        assert self.learner is not None and self.rollout is not None
        if held > self.version:
            log.warning("trainer.generators_ahead", held=held, checkpoint_version=self.version, new_version=held + 1)
            self.version = held + 1
        if self.version > 0:
            self.learner.publish(self.version)
            await self._tell_env_hosts(PolicyVersion(self.version, self.version - self.rollout.alpha))

    async def _consume(self) -> None:
        """Take batches as they complete; in rollout-only mode record them instead of training."""
        assert self.rollout is not None
        record = JsonlLog(self.run_dir.rollout)
        while self.rollout.steps is None or self.batches < self.rollout.steps:
            batch = await self.buffer.take()
            await self.unpaused.wait()  # paused: no step starts, not even on a batch that filled meanwhile
            self.last_rewards = [t.reward for group in batch for t in group.trajectories]
            if self.learner is not None:
                await self._train(batch)
                continue
            simulated = self.topology.run.sim.trainer is not None
            self.dispenser.held = simulated and self.rollout.schedule == "sync"
            self.dispenser.changed()
            if self.on_batch is not None:
                self.on_batch(self.version, batch)
            else:
                lines = [{"version": self.version, "group": as_record(group)} for group in batch]
                await asyncio.to_thread(record.write, lines)
            self.batches += 1
            log.info("trainer.batch", step=self.batches, version=self.version, groups=len(batch))
            if simulated:
                await self._simulated_step(batch)
            elif self.rollout.bump_version_every_batch:
                await self.bump_version()
        if self.learner is not None and self.batches > self.last_checkpoint_step:
            await self._checkpoint()
        self.done = True
        self.finished.set()
        self.dispenser.done = True
        self.dispenser.changed()
        await self._tell_env_hosts(PolicyVersion(self.version, self.version + 1, done=True))
        log.info("trainer.done", batches=self.batches, version=self.version)

    async def _simulated_step(self, batch: list[GroupDone]) -> None:
        """Simulation mode (`run.sim.trainer`): the modelled training step on the batch's tokens, a new
        version, and the weight push: a synchronous push (and the sync schedule, with the dispenser
        held) waits while every engine receives its copy over the link, generation stopped; an
        asynchronous one goes on at once while each engine receives in the background and stops only
        to load from host memory."""
        from rollart.sim.hardware import GPUS, MODELS, train_step_s, transfer_s

        sim = self.topology.run.sim
        assert sim.trainer is not None and self.rollout is not None
        model, gpu = MODELS[sim.model], GPUS[sim.trainer.gpu]
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for group in batch for t in group.trajectories)
        await self.clock.sleep(train_step_s(model, gpu, gpus=sim.trainer.gpus, mfu=sim.trainer.mfu, tokens=tokens))
        await self.bump_version()
        generators = {
            peer.name: sim.engines[peer.hardware]
            for peer in self.topology.nodes_with_role(Role.GENERATOR)
            if peer.hardware in sim.engines
        }
        copies = sum(shape.replicas for shape in generators.values())  # each replica receives its own copy
        cross_s = transfer_s(model, gbps=sim.trainer.link_gbps) * copies
        if self.rollout.schedule == "sync" or sim.trainer.push == "sync":
            pushes = [self._sim_push(name, after_s=0.0, pause_s=cross_s) for name in generators]
            await asyncio.gather(*pushes, self.clock.sleep(cross_s))
            self.dispenser.held = False
            self.dispenser.changed()
        else:
            for name, shape in generators.items():
                load_s = model.weight_bytes / shape.gpus / (sim.trainer.host_load_gbs * 1e9)
                self._background.add(task := asyncio.ensure_future(self._sim_push(name, cross_s, load_s)))
                task.add_done_callback(self._background.discard)

    async def _sim_push(self, generator: str, after_s: float, pause_s: float) -> None:
        client = self.clients[generator]
        try:
            await client.request(SimWeights(self.version, after_s, pause_s), timeout=SYNC_PUSH_TIMEOUT_S)
        except RollartError as exc:  # the push is a model: a generator gone is logged, not fatal
            log.warning("trainer.sim_push_failed", generator=generator, error=str(exc))

    async def _train(self, batch: list[GroupDone]) -> None:
        """Train on a batch, bump the version, start the push; the sync baseline waits for the push."""
        assert self.learner is not None and self.rollout is not None
        sync = self.rollout.schedule == "sync"
        self.dispenser.held = sync
        self.dispenser.changed()
        async with self._step_lock:
            stats = await self.learner.train(batch, version=self.version)
            self.trained_s += stats["train_s"]
            self.batches += 1
            await self.bump_version()
            # The snapshot copy is the trainer's only wait; off the event loop, which keeps serving.
            await asyncio.to_thread(self.learner.publish, self.version)
        if sync:
            try:
                await self.learner.publisher.wait_delivered(self.version, timeout=SYNC_PUSH_TIMEOUT_S)
            except TimeoutError:
                log.warning("trainer.push_not_delivered", version=self.version, timeout_s=SYNC_PUSH_TIMEOUT_S)
            self.dispenser.held = False
            self.dispenser.changed()
        line = self.learner.record(self.batches, self.version, batch, stats)
        log.info(
            "trainer.step",
            step=self.batches,
            version=self.version,
            reward=round(line["reward_mean"], 4),
            success=round(line["success_rate"], 4),
            loss=round(stats["loss"], 5),
            train_s=round(stats["train_s"], 3),
        )
        every = self.learner.spec.checkpoint_every
        if every and self.batches % every == 0:
            await self._checkpoint()

    async def _checkpoint(self) -> None:
        assert self.learner is not None
        async with self._step_lock:
            if self.batches == self.last_checkpoint_step:
                return
            buffered = [(g.trajectories[0].task, g.trajectories[0].seed) for g in self.buffer.peek()]
            await self.learner.checkpoint(
                step=self.batches, version=self.version, dispenser=self.dispenser.state_dict(buffered)
            )
            self.last_checkpoint_step = self.batches

    async def bump_version(self) -> None:
        """The policy moved to a new version: drop and abort what it makes too stale."""
        assert self.rollout is not None
        self.version += 1
        min_start = self.version - self.rollout.alpha
        for group in self.buffer.drop_stale(self.version):
            self.dispenser.requeue(group.trajectories[0].task, group.trajectories[0].seed, "dropped as stale")
        await self._tell_env_hosts(PolicyVersion(self.version, min_start))
        self.dispenser.changed()

    async def _tell_env_hosts(self, notice: PolicyVersion) -> None:
        for session in list(self.server.sessions.values()):
            if session.peer is not None and session.peer.role == Role.ENV_HOST.value and not session.finished:
                await session.send(notice)

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            self.dispenser.expire()

    def pause(self) -> None:
        super().pause()
        if self.rollout is not None:
            self.dispenser.paused = True

    def resume(self) -> None:
        super().resume()
        if self.rollout is not None:
            self.dispenser.paused = False
            self.dispenser.changed()

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
                    self._env_host_sessions[env_host] = session.id
                task = await self.dispenser.grant(env_host, lambda: self.version, wait_s=min(wait_s, 30.0))
                if task is not None:
                    return task
                if self.done:
                    return NoTask("the run is done", done=True)
                return NoTask("paused" if self.paused else "at the alpha admission limit")
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

    async def drain_work(self) -> None:
        learner = self.learner
        if learner is not None and learner.engine is not None and self.batches > self.last_checkpoint_step:
            await self._checkpoint()
        if self.rollout is not None:
            log.info(
                "trainer.summary",
                version=self.version,
                batches=self.batches,
                **self.dispenser.stats(),
                buffer=self.buffer.stats(),
            )

    def progress(self) -> str:
        if self.rollout is None:
            return ""
        if self.learner is not None:
            return self._training_progress()
        steps = self.rollout.steps if self.rollout.steps is not None else "-"
        rewards = self.last_rewards
        mean = f", mean reward {sum(rewards) / len(rewards):.3f}" if rewards else ""
        return f"batch {self.batches}/{steps}, version {self.version}{mean}"

    def _training_progress(self) -> str:
        assert self.learner is not None and self.rollout is not None
        line = self.learner.last_stats
        steps = self.rollout.steps if self.rollout.steps is not None else "-"
        if not line:
            return f"step {self.batches}/{steps}, version {self.version}: waiting for the first batch"
        tasks = " ".join(
            f"{name} reward {t['reward_ma']:.2f} success {t['success_ma']:.2f}" for name, t in line["tasks"].items()
        )
        busy = " ".join(f"{name} {value:.0%}" for name, value in line["generator_busy"].items()) or "-"
        return (
            f"step {self.batches}/{steps} | {tasks} (20-step avg) | stale {line.get('staleness_mean', 0.0):.2f} | "
            f"{line['traj_per_s']:.1f} traj/s | busy {busy}"
        )

    def role_gauges(self) -> dict[str, tuple[str, float]]:
        last = self.learner.last_stats if self.learner is not None else {}
        gauges: dict[str, tuple[str, float]] = {
            "rollart_trainer_steps": ("Steps trained (batches taken in rollout-only mode)", self.batches)
        }
        for key, doc in TRAINER_STEP_GAUGES.items():
            if isinstance(last.get(key), int | float):
                gauges[f"rollart_trainer_last_{key}"] = (doc, last[key])
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
        if self.learner is not None:
            status["training"] = {
                "schedule": self.rollout.schedule if self.rollout else None,
                "last_step": self.learner.last_stats,
                "baseline": self.learner.baseline,
                "weights": {name: vars(stats) for name, stats in self.learner.publisher.stats().items()},
                "stall_s_max": max(self.learner.stall_s, default=0.0),
            }
        return status


def as_record(value: Any) -> Any:
    """Wire structs are array-like; records on disk name their fields."""
    if isinstance(value, msgspec.Struct):
        return {name: as_record(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list):
        return [as_record(item) for item in value]
    return value
