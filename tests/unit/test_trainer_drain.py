"""A trainer drained mid-run: its last checkpoint is at the last step it trained, and a batch it took
and did not train on is kept in that checkpoint to run again (chaos CI found a step recorded after the
drain's checkpoint: the drain had looked for new steps while one was still training)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from rollart.nodes.trainer_steps import TrainStep


class Learner:
    """Trains when released; records what each checkpoint would keep."""

    def __init__(self) -> None:
        self.spec = SimpleNamespace(checkpoint_every=0)
        self.engine = object()
        self.training = asyncio.Event()
        self.release = asyncio.Event()
        self.trained: list[int] = []
        self.checkpoints: list[dict[str, Any]] = []

    async def train(self, batch: list[Any], *, version: int) -> dict[str, float]:
        self.training.set()
        await self.release.wait()
        self.trained.append(batch[0].trajectories[0].seed)
        return {"train_s": 0.0, "loss": 0.0}

    async def publish(self, version: int) -> None:
        pass

    def push_record(self) -> dict[str, float]:
        return {}

    async def checkpoint(self, *, step: int, version: int, elapsed_s: float, dispenser: dict[str, Any]) -> None:
        self.checkpoints.append({"step": step, **dispenser})

    async def saved(self) -> None:
        pass


class Records:
    """What a step writes of itself, and nothing."""

    def step(self, step: int, version: int, batch: list[Any], stats: dict[str, float], **_: Any) -> dict[str, float]:
        return {"reward_mean": 0.0, "success_rate": 0.0}

    def elapsed_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


class Dispenser:
    held, ahead, incarnation = False, 0, 0

    def hold(self, held: bool = True) -> None:
        self.held = held

    def release(self) -> None:
        self.held = False

    def state_dict(self, buffered: list[tuple[str, int]]) -> dict[str, Any]:
        return {"retry": buffered}


class Core:
    """The trainer node's part a step works on (`TrainerCore`)."""

    def __init__(self) -> None:
        self.versions = Versions()
        self.batches = 0
        self.draining = False
        self.untrained: list[Any] = []
        self.trained_s = self.wait_s = 0.0
        self.dispenser, self.evaluator, self.on_batch = Dispenser(), None, None
        self.buffer = SimpleNamespace(peek=lambda: batch(9))


class Versions:
    version = 0

    async def advance(self) -> None:
        self.version += 1


def batch(seed: int) -> list[Any]:
    return [SimpleNamespace(trajectories=[SimpleNamespace(task="math", seed=seed)])]


def train_step(learner: Learner, core: Core) -> TrainStep:
    rollout = SimpleNamespace(schedule="async", steps=None)
    return TrainStep(core, learner, Records(), rollout)  # type: ignore[arg-type]


async def test_a_drain_during_a_step_checkpoints_that_step() -> None:
    learner, core = Learner(), Core()
    steps = train_step(learner, core)
    core.untrained = batch(1)
    step = asyncio.create_task(steps.step(core.untrained))
    await learner.training.wait()
    core.draining = True
    drain = asyncio.create_task(steps.drain())
    await asyncio.sleep(0.01)
    assert learner.checkpoints == []  # the drain waits for the step in flight
    learner.release.set()
    await asyncio.gather(step, drain)
    assert learner.trained == [1]
    assert learner.checkpoints == [{"step": 1, "retry": [("math", 9)]}]


async def test_a_batch_taken_while_draining_is_not_trained_and_runs_again_after_a_restart() -> None:
    learner, core = Learner(), Core()
    learner.release.set()
    steps = train_step(learner, core)
    core.untrained = batch(1)
    await steps.step(core.untrained)
    core.draining = True
    core.untrained = batch(2)  # taken as the drain began
    await asyncio.gather(steps.step(core.untrained), steps.drain())
    assert learner.trained == [1]
    assert learner.checkpoints == [{"step": 1, "retry": [("math", 2), ("math", 9)]}]
