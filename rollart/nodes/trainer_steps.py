"""What the trainer node does with each batch it takes: one step strategy per mode, chosen once at start.

The node (`rollart.nodes.trainer`) owns the policy version (`PolicyVersions`), the SampleBuffer and the
dispenser, and takes batches; a `StepStrategy` says what a batch is for:

- `TrainStep` (`rollout.mode: train`): the `Learner` trains on it, the version moves on and the
  weights go to generators without the trainer waiting; with `schedule: sync` the dispenser is held
  while it trains and until every generator has loaded the new weights (the synchronous baseline).
  It also brings the generators in line before the first group, and checkpoints.
- `RolloutOnlyStep` (`rollout-only`, `rollart.nodes.trainer_rollout_only`): records the batch (to the
  run folder's `RunDir.rollout`, or to the node's `on_batch`) and, when asked to, counts it as a new
  policy version, which drops and aborts whatever that version makes too stale, exactly as training would.
- `SimulatedStep` (`rollout-only` with `run.sim.trainer`, beside it): records it too, then costs a
  modelled training step and weight push on the simulation clock.

The node picks one from the topology when it starts (`TrainerNode._choose_steps`); nothing else asks which
mode the node is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import structlog

from rollart.protocol.messages import GroupDone

if TYPE_CHECKING:
    from rollart.nodes.learner import Learner
    from rollart.rollout.buffer import SampleBuffer
    from rollart.rollout.config import RolloutSpec
    from rollart.rollout.dispenser import Dispenser
    from rollart.rollout.evaluation import Evaluator
    from rollart.rollout.versions import PolicyVersions
    from rollart.tracking.records import StepRecords

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
    """`rollout.mode: train`: a GRPO step per batch, a new version, the weight push, the step's records,
    checkpoints."""

    makes_versions = True

    def __init__(self, core: TrainerCore, learner: Learner, records: StepRecords, rollout: RolloutSpec) -> None:
        self.core, self.learner, self.records, self.rollout = core, learner, records, rollout
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
        held = await learner.targets.connect()
        if state is None:
            self.records.start()
            await self._measure_baseline()
        else:  # continue from a checkpoint: same step and version, same groups to run
            self.records.start(step=int(state["step"]) + 1, elapsed_s=float(state["elapsed_s"]))
            core.versions.resume(int(state["version"]))
            core.batches = self.last_checkpoint_step = int(state["step"])
            core.dispenser.load_state(state["dispenser"])
        claimed = await asyncio.to_thread(learner.run_dir.claim_incarnation)
        core.dispenser.incarnation = max(core.dispenser.incarnation, claimed)
        await self._bring_generators_in_line(held)
        core.dispenser.release()
        if core.evaluator is not None:
            core.evaluator.incarnation = core.dispenser.incarnation
            self._evaluate()  # the policy before any step (or as the checkpoint left it)

    async def _measure_baseline(self) -> None:
        """The uniformly random valid policy's success and reward on each task, as the run's first record."""
        from rollart.tiny.warmup import random_policy_baselines

        baseline = await asyncio.to_thread(random_policy_baselines, self.rollout.tasks, seed=self.rollout.seed)
        self.records.write_baseline(baseline)

    async def _bring_generators_in_line(self, held: int) -> None:
        """Before any group starts, every generator must run this trainer's weights.

        A generator may hold a version this trainer never saved or never had: the trainer's weights then
        take the version above it (`PolicyVersions.jump_above`)."""
        versions = self.core.versions
        versions.jump_above(held)
        if versions.version > 0:
            await self.learner.publish(versions.version)
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
            # Ordering the export before the next step is the trainer's only wait; the push starts in the background.
            await learner.publish(version)
        if sync:
            try:
                await learner.publisher.wait_delivered(version, timeout=SYNC_PUSH_TIMEOUT_S)
            except TimeoutError:
                log.warning("trainer.push_not_delivered", version=version, timeout_s=SYNC_PUSH_TIMEOUT_S)
            core.dispenser.release()
        line = self.records.step(
            core.batches,
            version,
            batch,
            stats,
            weights=learner.push_record(),
            incarnation=core.dispenser.incarnation,
        )
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
                step=core.batches,
                version=core.versions.version,
                elapsed_s=self.records.elapsed_s(),
                dispenser=core.dispenser.state_dict(buffered),
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
        try:
            await self.learner.close()
        finally:
            await asyncio.to_thread(self.records.close)

    async def drain(self) -> None:
        if self.learner.engine is not None:  # after the step in flight, if any (`_checkpoint` waits for it)
            await self._checkpoint()
        await self.learner.saved()
        # The node cancels the work after a drain, so `close` may not come: the trackers' runs end here.
        await asyncio.to_thread(self.records.close)
