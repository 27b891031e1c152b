"""The SampleBuffer: finished groups waiting for the trainer, under the staleness bound alpha.

Every trajectory is stamped with the policy version that *started* it (the trainer's version at
its first generation call). The buffer holds only groups whose every trajectory the bound admits
(`rollart.rollout.staleness`): `put` refuses an older group and `drop_stale` removes the ones a new
version left behind. `take` hands out a batch as soon as `batch_groups`
groups are there: the groups that started earliest (closest to going stale), in arrival order among
equals. A long group that finished after younger ones is trained before a version bump drops it,
where taking by arrival would leave it behind to go stale.

With `dynamic_sampling` (DAPO's dynamic sampling) a group whose rewards are all equal, so whose
group-relative advantage is zero everywhere, does not count toward the batch: `take` waits for
`batch_groups` groups *with* signal and hands out the uniform ones that came in meanwhile beside
them (the learner leaves them out of the gradient, or keeps a few as its anchor; the batch's
metrics still see every group sampled). A task that is solved, or not yet solvable, then no
longer crowds the others out of the gradient. So that a mix without signal anywhere still steps,
a batch is handed out anyway once `max_uniform_batches` batches' worth of uniform groups wait.
Admission counts only groups with signal (`len`), so generation goes on while uniform ones pile up.
"""

from __future__ import annotations

import asyncio
import collections

from rollart.algorithms.selection import has_signal
from rollart.protocol.messages import GroupDone
from rollart.rollout.staleness import StalenessBound


def started_at(group: GroupDone) -> int:
    """The oldest start version among a group's trajectories."""
    return min(t.started_at_version for t in group.trajectories)


class SampleBuffer:
    """Groups ready for training, oldest first."""

    def __init__(
        self, *, batch_groups: int, bound: StalenessBound, dynamic_sampling: bool = False, max_uniform_batches: int = 4
    ):
        self.batch_groups = batch_groups
        self.bound = bound
        self.dynamic_sampling = dynamic_sampling
        self.max_uniform = max_uniform_batches * batch_groups
        self._groups: collections.deque[GroupDone] = collections.deque()
        self._uniform: collections.deque[GroupDone] = collections.deque()
        """With dynamic sampling: groups without signal, waiting to go out beside a batch."""
        self._changed = asyncio.Event()
        self.accepted = 0
        self.refused_stale = 0
        self.dropped_stale = 0
        self.taken = 0
        self.uniform = 0

    def __len__(self) -> int:
        """Groups toward the next batch (with dynamic sampling, those with signal)."""
        return len(self._groups)

    def put(self, group: GroupDone, version: int) -> tuple[bool, str]:
        """Add a group unless it breaks the bound at `version`; says why when it does not."""
        oldest = started_at(group)
        if not self.bound.admits(oldest, version):
            self.refused_stale += 1
            return False, f"stale: a trajectory started at version {oldest}, the policy is at {version}"
        if self.dynamic_sampling and not has_signal([t.reward for t in group.trajectories]):
            self._uniform.append(group)
            self.uniform += 1
        else:
            self._groups.append(group)
        self.accepted += 1
        self._changed.set()
        return True, ""

    def drop_stale(self, version: int) -> list[GroupDone]:
        """Remove and return the groups that `version` makes too old."""
        dropped: list[GroupDone] = []
        for queue in (self._groups, self._uniform):
            keep = [group for group in queue if self.bound.admits(started_at(group), version)]
            dropped += [group for group in queue if not self.bound.admits(started_at(group), version)]
            queue.clear()
            queue.extend(keep)
        self.dropped_stale += len(dropped)
        return dropped

    def ready(self) -> bool:
        """A batch is complete: `take` would return at once."""
        return len(self._groups) >= self.batch_groups or len(self._uniform) >= self.max_uniform

    async def take(self) -> list[GroupDone]:
        """Wait for `batch_groups` groups and return them, earliest started first (with dynamic sampling,
        the uniform groups waiting follow them)."""
        while not self.ready():
            self._changed.clear()
            await self._changed.wait()
        by_start = sorted(self._groups, key=started_at)  # stable: arrival order among equal starts
        batch = by_start[: self.batch_groups]
        taken = {id(group) for group in batch}
        self._groups = collections.deque(group for group in self._groups if id(group) not in taken)
        batch += self._uniform
        self._uniform.clear()
        self.taken += len(batch)
        return batch

    def peek(self) -> list[GroupDone]:
        """The groups buffered now, oldest first (not removed)."""
        return [*self._groups, *self._uniform]

    def stats(self) -> dict[str, int]:
        return {
            "depth": len(self._groups) + len(self._uniform),
            "accepted": self.accepted,
            "refused_stale": self.refused_stale,
            "dropped_stale": self.dropped_stale,
            "taken": self.taken,
            "uniform": self.uniform,
        }
