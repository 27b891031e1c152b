"""The trainer node's steps when it does not train (`rollout.mode: rollout-only`): record each batch, and
count it as a new policy version when asked to, or model a training step and a weight push on the simulation
clock (`run.sim.trainer`). `rollart.nodes.trainer_steps` says what a step strategy is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from rollart.clock import SimClock
from rollart.errors import RollartError
from rollart.nodes.trainer_steps import SYNC_PUSH_TIMEOUT_S, TrainerCore
from rollart.protocol.messages import GroupDone, SimWeights
from rollart.rundir import JsonlLog, RunDir

if TYPE_CHECKING:
    from rollart.protocol import ClientSession
    from rollart.rollout.config import RolloutSpec
    from rollart.sim.config import SimSpec
    from rollart.sim.hardware import EngineShape

log = structlog.get_logger("rollart.trainer")


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
