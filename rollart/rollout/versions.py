"""The trainer's policy version: the one place it changes, and what each change does.

The version changes in four ways, each a method here: a step makes the next one (`advance`), a restart
continues from a checkpoint's (`resume`), a trainer that finds generators holding a newer version than its
checkpoint names its weights above theirs (`jump_above`: versions only increase, so two different weights never
share a number), and, before that, a taken batch foretells the next one (`foresee`).

The next batch is taken at one version (`next_batch_version`: the current one, or the one after while a batch
is trained on), and the staleness bound (`rollart.rollout.staleness`) says which starts that batch may hold. So
`foresee` and `advance` drop from the `SampleBuffer` the groups that version leaves too stale (their task and
seed run again, `Dispenser.requeue`), move the dispenser's admission with it, and announce it to the env-hosts,
who abort the trajectories it leaves too stale and stamp new ones with it (`PolicyVersion`). `resume` and
`jump_above` come before the first group is granted, with nothing to drop; the trainer then `announce`s where
it starts. The announcement is made here only, by one formula.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from rollart.protocol.messages import PolicyVersion
from rollart.rollout.buffer import SampleBuffer
from rollart.rollout.dispenser import Dispenser
from rollart.rollout.staleness import StalenessBound

log = structlog.get_logger("rollart.trainer")

Announce = Callable[[PolicyVersion], Awaitable[None]]


class PolicyVersions:
    """The trainer's policy version, the bound it enforces, and the parts each change moves (module docstring)."""

    def __init__(self, bound: StalenessBound, buffer: SampleBuffer, dispenser: Dispenser, announce: Announce) -> None:
        """`announce` sends a notice to every env-host."""
        self.bound = bound
        self._buffer, self._dispenser, self._announce = buffer, dispenser, announce
        self._version = 0

    @property
    def version(self) -> int:
        """The version of the weights the trainer holds now."""
        return self._version

    @property
    def next_batch_version(self) -> int:
        """The version the next batch will be taken at: one more while a batch is trained on."""
        return self._version + 1 if self._dispenser.training else self._version

    async def foresee(self) -> None:
        """A batch was taken whose step makes the next version, and the next batch is taken at that one: what it
        will make too stale cannot be used any more, so it gives its room back now rather than when the step
        ends, and admission counts one batch fewer meanwhile (`Dispenser.training`)."""
        self._dispenser.set_training(True)
        await self._changed()

    async def advance(self) -> None:
        """A step made the next version."""
        self._version += 1
        self._dispenser.set_training(False)
        await self._changed()

    def resume(self, version: int) -> None:
        """Continue from a checkpoint's version, before any group is granted (nothing is in flight to drop)."""
        self._version = version

    def jump_above(self, held: int) -> None:
        """Generators hold `held`, a version this trainer never saved (pushed by the run it resumes, after its
        last checkpoint) or never had (no checkpoint at all): rolling back would let two different weights share
        a number, so its weights become the version after theirs."""
        if held > self._version:
            log.warning("trainer.generators_ahead", held=held, checkpoint_version=self._version, new_version=held + 1)
            self._version = held + 1

    async def announce(self) -> None:
        """Tell the env-hosts the version and the oldest admissible start (also when nothing changed: a trainer
        that resumes says where it is)."""
        min_start = self.bound.oldest_start(self.next_batch_version)
        await self._announce(PolicyVersion(self._version, min_start))

    async def finish(self) -> None:
        """The run is over: the env-hosts end what they run (nothing started now can be trained)."""
        await self._announce(PolicyVersion(self._version, self._version + 1, done=True))

    async def _changed(self) -> None:
        for group in self._buffer.drop_stale(self.next_batch_version):
            first = group.trajectories[0]
            self._dispenser.requeue(first.task, first.seed, "dropped as stale")
        await self.announce()
