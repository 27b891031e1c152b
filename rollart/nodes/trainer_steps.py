"""What the trainer node does with each batch it takes: one step strategy per mode, chosen once at start.

The node (`rollart.nodes.trainer`) owns the policy version (`PolicyVersions`), the SampleBuffer and the
dispenser, and takes batches; a `StepStrategy` says what a batch is for:

- `TrainStep` (`rollout.mode: train`): the `Learner` trains on it, the version moves on and the
  weights go to generators without the trainer waiting; with `schedule: sync` the dispenser is held
  while it trains and until every generator has loaded the new weights (the synchronous baseline).
  It also brings the generators in line before the first group, and checkpoints.
- `RolloutOnlyStep` (`rollout-only`): records the batch (to the run folder's `RunDir.rollout`, or
  to the node's `on_batch`) and, when asked to, counts it as a new policy version, which drops and
  aborts whatever that version makes too stale, exactly as training would.
- `SimulatedStep` (`rollout-only` with `run.sim.trainer`): records it too, then costs a modelled
  training step and weight push on the simulation clock.

`choose_step` picks one from the topology; nothing else asks which mode the node is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import structlog

from rollart.clock import SimClock
from rollart.errors import RollartError
from rollart.protocol.messages import GroupDone, SimWeights
from rollart.rundir import JsonlLog, RunDir

if TYPE_CHECKING:
    from rollart.nodes.learner import Learner
    from rollart.protocol import ClientSession
    from rollart.rollout.buffer import SampleBuffer
    from rollart.rollout.config import RolloutSpec
    from rollart.rollout.dispenser import Dispenser
    from rollart.rollout.evaluation import Evaluator
    from rollart.rollout.versions import PolicyVersions
    from rollart.sim.config import SimSpec
    from rollart.sim.hardware import EngineShape

log = structlog.get_logger("rollart.trainer")

SYNC_PUSH_TIMEOUT_S = 600.0
"""The synchronous baseline waits this long for every generator to load a version, then goes on."""
FINAL_PUSH_S = 30.0
"""At the end of a run, how long the trainer waits for generators to load the last version."""
FINAL_PUSH_POLL_S = 0.25
"""...looking this often whether the node drains meanwhile."""


class TrainerCore(Protocol):
    """The part of the trainer node a step strategy works on."""

    versions: PolicyVersions
    """The policy version: every change of it goes through here (`rollart.rollout.versions`)."""
    batches: int
    draining: bool
    untrained: list[GroupDone]
    """The batch taken and not yet trained on."""
    trained_s: float
    wait_s: float
    """How long the trainer waited for the last batch to fill."""
    dispenser: Dispenser
    evaluator: Evaluator | None
    buffer: SampleBuffer
    on_batch: Callable[[int, list[GroupDone]], None] | None


class StepStrategy(Protocol):
    """One mode of the trainer node, from its start to its end."""

    @property
    def makes_versions(self) -> bool:
        """Each step makes a new policy version (so the batch after it is taken at that version)."""

    async def start(self, tg: asyncio.TaskGroup) -> None:
        """Before any group starts (long-lived tasks go into `tg`)."""

    async def step(self, batch: list[GroupDone]) -> None:
        """A batch was taken: use it, and count it in `batches`."""

    async def finish(self) -> None:
        """The last batch is taken; env-hosts are told next."""

    async def close(self) -> None:
        """The run is over: let what is in flight land."""

    async def drain(self) -> None:
        """The node drains: keep what a restart needs."""


class TrainStep:
    """`rollout.mode: train`: a GRPO step per batch, a new version, the weight push, checkpoints."""

    makes_versions = True

    def __init__(self, core: TrainerCore, learner: Learner, rollout: RolloutSpec) -> None:
        self.core, self.learner, self.rollout = core, learner, rollout
        self.last_checkpoint_step = 0
        self._lock = asyncio.Lock()
        """Held by a training step and by a checkpoint, so a drain's checkpoint never sees half a step."""
        self._watch: asyncio.Task[None] | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        core, learner = self.core, self.learner
        core.dispenser.hold()  # nothing starts before the weights are ready
        state = await learner.start()
        self._watch = tg.create_task(learner.watch_engine())  # a dead rank fails the node at once
        tg.create_task(learner.publisher.run())
        held = await learner.connect_generators()
        if state is not None:  # continue from a checkpoint: same step and version, same groups to run
            core.versions.resume(int(state["version"]))
            core.batches = self.last_checkpoint_step = int(state["step"])
            core.dispenser.load_state(state["dispenser"])
        claimed = await asyncio.to_thread(learner.claim_incarnation)
        core.dispenser.incarnation = max(core.dispenser.incarnation, claimed)
        await self._bring_generators_in_line(held)
        core.dispenser.release()
        if core.evaluator is not None:
            core.evaluator.incarnation = core.dispenser.incarnation
            self._evaluate()  # the policy before any step (or as the checkpoint left it)

    async def _bring_generators_in_line(self, held: int) -> None:
        """Before any group starts, every generator must run this trainer's weights.

        A generator may hold a version this trainer never saved or never had: the trainer's weights then
        take the version above it (`PolicyVersions.jump_above`)."""
        versions = self.core.versions
        versions.jump_above(held)
        if versions.version > 0:
            self.learner.publish(versions.version)
            await versions.announce()

    async def step(self, batch: list[GroupDone]) -> None:
        """Train on a batch, bump the version, start the push; the sync baseline waits for the push."""
        core, learner = self.core, self.learner
        sync = self.rollout.schedule == "sync"
        core.dispenser.hold(sync)
        async with self._lock:
            if core.draining:  # the drain's checkpoint keeps the batch (`untrained`) to run again
                return
            stats = await learner.train(batch, version=core.versions.version)
            stats["time_wait_s"] = core.wait_s
            stats["lookahead"] = core.dispenser.ahead
            core.trained_s += stats["train_s"]
            core.batches += 1
            core.untrained = []
            await core.versions.advance()
            version = core.versions.version
            # The snapshot copy is the trainer's only wait; off the event loop, which keeps serving.
            await asyncio.to_thread(learner.publish, version)
        if sync:
            try:
                await learner.publisher.wait_delivered(version, timeout=SYNC_PUSH_TIMEOUT_S)
            except TimeoutError:
                log.warning("trainer.push_not_delivered", version=version, timeout_s=SYNC_PUSH_TIMEOUT_S)
            core.dispenser.release()
        line = learner.record(core.batches, version, batch, stats, incarnation=core.dispenser.incarnation)
        log.info(
            "trainer.step",
            step=core.batches,
            version=version,
            reward=round(line["reward_mean"], 4),
            success=round(line["success_rate"], 4),
            loss=round(stats["loss"], 5),
            train_s=round(stats["train_s"], 3),
        )
        self._evaluate()
        every = learner.spec.checkpoint_every
        if every and core.batches % every == 0:
            await self._checkpoint()

    def _evaluate(self) -> None:
        """Start a held-out evaluation round when this step is due one (`rollart.rollout.evaluation`)."""
        core = self.core
        if core.evaluator is not None and core.evaluator.due(core.batches, self.rollout.steps):
            core.evaluator.start(core.batches, core.versions.version)
            core.dispenser.wake_all()  # env-hosts waiting for room take the round's groups now

    async def _checkpoint(self) -> None:
        core = self.core
        async with self._lock:
            if core.batches == self.last_checkpoint_step:
                return
            waiting = [*core.untrained, *core.buffer.peek()]
            buffered = [(g.trajectories[0].task, g.trajectories[0].seed) for g in waiting]
            await self.learner.checkpoint(
                step=core.batches, version=core.versions.version, dispenser=core.dispenser.state_dict(buffered)
            )
            self.last_checkpoint_step = core.batches

    async def finish(self) -> None:
        core = self.core
        if core.evaluator is not None and core.evaluator.rounds:  # the last round, before env-hosts are told
            core.dispenser.hold()  # no more training work meanwhile
            timeout = self.rollout.group_timeout_s
            if not await core.evaluator.wait_idle(timeout):
                log.warning("trainer.eval_unfinished", rounds=sorted(core.evaluator.rounds), waited_s=timeout)
        if core.batches > self.last_checkpoint_step:
            await self._checkpoint()
        await self.learner.saved()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()  # closing the engine is no failure
        # Let the last version land, within reason, and not once the node drains: the launcher drains
        # every node when the run ends, generators go, and a trainer group's members wait for the ranks.
        waited = 0.0
        while waited < FINAL_PUSH_S and not self.core.draining:
            try:
                await self.learner.publisher.wait_delivered(self.core.versions.version, timeout=FINAL_PUSH_POLL_S)
                break
            except TimeoutError:
                waited += FINAL_PUSH_POLL_S
        await self.learner.publisher.close()
        await self.learner.close()

    async def drain(self) -> None:
        if self.learner.engine is not None:  # after the step in flight, if any (`_checkpoint` waits for it)
            await self._checkpoint()
        await self.learner.saved()
        await self.learner.close_trackers()  # the node cancels the work after a drain: `close` may not come


class RolloutOnlyStep:
    """`rollout-only`: record each batch, and with `bump_version_every_batch` count it as a version."""

    def __init__(self, core: TrainerCore, rollout: RolloutSpec, run_dir: RunDir) -> None:
        self.core, self.rollout = core, rollout
        self.out = JsonlLog(run_dir.rollout)

    @property
    def makes_versions(self) -> bool:
        return self.rollout.bump_version_every_batch

    async def start(self, tg: asyncio.TaskGroup) -> None:
        pass

    async def _record(self, batch: list[GroupDone], *, hold: bool) -> None:
        core = self.core
        core.dispenser.hold(hold)
        version = core.versions.version
        if core.on_batch is not None:
            core.on_batch(version, batch)
        else:
            lines = [{"version": version, "group": as_record(group)} for group in batch]
            await asyncio.to_thread(self.out.write, lines)
        core.batches += 1
        log.info("trainer.batch", step=core.batches, version=version, groups=len(batch))

    async def step(self, batch: list[GroupDone]) -> None:
        await self._record(batch, hold=False)
        if self.rollout.bump_version_every_batch:
            await self.core.versions.advance()

    async def finish(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def drain(self) -> None:
        pass


class SimulatedStep(RolloutOnlyStep):
    """`run.sim.trainer`: each batch also costs the modelled training step on the batch's tokens, a
    new version, and the weight push, timed by `rollart/sim/weight_sync.py` (star or relay; a node
    holds a version when its last engine replica does).

    A synchronous push (and the sync schedule, with the dispenser held) waits until the last
    generator holds the version, each engine stopped until its own copy is in. An asynchronous one
    goes on at once: a background pusher sends the newest version whenever the trainer's egress is
    free (a version made while the previous one is still leaving is skipped if a newer one follows,
    as the real publisher sends only the newest), and each engine stops only to load it from host
    memory."""

    def __init__(
        self,
        core: TrainerCore,
        rollout: RolloutSpec,
        run_dir: RunDir,
        *,
        sim: SimSpec,
        generators: Mapping[str, EngineShape],
        clients: Mapping[str, ClientSession],
    ) -> None:
        from rollart.sim.hardware import MODELS
        from rollart.sim.weight_sync import Links, engine_places, sync_times

        super().__init__(core, rollout, run_dir)
        assert sim.trainer is not None  # choose_step picks this strategy only then
        self.sim, self.generators, self.clients = sim, dict(generators), clients
        self.clock = SimClock(sim.speedup)
        self._background: set[asyncio.Future[None]] = set()
        """Asynchronous weight pushes in flight."""
        trainer, model = sim.trainer, MODELS[sim.model]
        places = engine_places(self.generators)
        self.sync = sync_times(
            model.weight_bytes,
            [place for _, place in places],
            trainer.plan,
            fanout=trainer.relay_fanout,
            bucket_bytes=trainer.bucket_mb << 20,
            links=Links(cross_gbps=trainer.link_gbps, cluster_gbps=trainer.cluster_gbps, host_gbps=trainer.host_gbps),
        )
        """One version's sync, the same every step."""
        self.arrival_s: dict[str, float] = {}
        """Per generator node: when its last replica holds a version, from the start of its push."""
        for (name, _), arrival in zip(places, self.sync.arrival_s, strict=True):
            self.arrival_s[name] = max(arrival, self.arrival_s.get(name, 0.0))
        self.load_s = {
            name: model.weight_bytes / shape.gpus / (trainer.host_load_gbs * 1e9)
            for name, shape in self.generators.items()
        }
        """Async push: per node, how long loading a version from host memory stops its engine."""
        self.pushed: list[int] = []
        """Versions sent, in order (async: the newest when the trainer's egress came free)."""
        self._new_version = asyncio.Event()
        self._pusher: asyncio.Task[None] | None = None

    @property
    def makes_versions(self) -> bool:
        return True

    @property
    def synchronous(self) -> bool:
        assert self.sim.trainer is not None
        return self.rollout.schedule == "sync" or self.sim.trainer.push == "sync"

    async def start(self, tg: asyncio.TaskGroup) -> None:
        if not self.synchronous:
            self._pusher = tg.create_task(self._push_newest(), name="sim-weight-pusher")

    async def close(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()

    async def step(self, batch: list[GroupDone]) -> None:
        from rollart.sim.hardware import GPUS, MODELS, train_step_s

        sim = self.sim
        assert sim.trainer is not None
        await self._record(batch, hold=self.rollout.schedule == "sync")
        model, gpu = MODELS[sim.model], GPUS[sim.trainer.gpu]
        tokens = sum(len(t.prompt_ids) + len(t.response_ids) for group in batch for t in group.trajectories)
        await self.clock.sleep(train_step_s(model, gpu, gpus=sim.trainer.gpus, mfu=sim.trainer.mfu, tokens=tokens))
        await self.core.versions.advance()
        if not self.synchronous:
            self._new_version.set()
            return
        version = self.core.versions.version
        self.pushed.append(version)
        pushes = [self._push(name, version, after_s=0.0, pause_s=self.arrival_s[name]) for name in self.generators]
        await asyncio.gather(*pushes, self.clock.sleep(self.sync.last_s))
        self.core.dispenser.release()

    async def _push_newest(self) -> None:
        """Async push: send the newest version each time the trainer's egress is free."""
        while True:
            await self._new_version.wait()
            self._new_version.clear()
            version = self.core.versions.version
            self.pushed.append(version)
            for name in self.generators:
                push = self._push(name, version, after_s=self.arrival_s[name], pause_s=self.load_s[name])
                self._background.add(task := asyncio.ensure_future(push))
                task.add_done_callback(self._background.discard)
            await self.clock.sleep(self.sync.trainer_busy_s)

    async def _push(self, generator: str, version: int, after_s: float, pause_s: float) -> None:
        try:
            await self.clients[generator].request(SimWeights(version, after_s, pause_s), timeout=SYNC_PUSH_TIMEOUT_S)
        except RollartError as exc:  # the push is a model: a generator gone is logged, not fatal
            log.warning("trainer.sim_push_failed", generator=generator, error=str(exc))


def as_record(value: Any) -> Any:
    """Wire structs are array-like; records on disk name their fields."""
    if isinstance(value, msgspec.Struct):
        return {name: as_record(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list):
        return [as_record(item) for item in value]
    return value
