"""The SampleBuffer: finished groups waiting for the trainer, under the staleness bound alpha.

Every trajectory is stamped with the policy version that *started* it (the trainer's version at
its first generation call). When the policy is at version n, the buffer holds only groups whose
every trajectory started at n - alpha or later: `put` refuses an older group and `drop_stale`
removes the ones a version bump left behind. `take` hands out a batch, oldest first, as soon as
`batch_groups` groups are there.
"""

from __future__ import annotations

import asyncio
import collections

from rollart.protocol.messages import GroupDone


def started_at(group: GroupDone) -> int:
    """The oldest start version among a group's trajectories."""
    return min(t.started_at_version for t in group.trajectories)


class SampleBuffer:
    """Groups ready for training, oldest first."""

    def __init__(self, *, batch_groups: int, alpha: int) -> None:
        self.batch_groups = batch_groups
        self.alpha = alpha
        self._groups: collections.deque[GroupDone] = collections.deque()
        self._changed = asyncio.Event()
        self.accepted = 0
        self.refused_stale = 0
        self.dropped_stale = 0
        self.taken = 0

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: GroupDone, version: int) -> tuple[bool, str]:
        """Add a group unless it breaks the bound at `version`; says why when it does not."""
        oldest = started_at(group)
        if oldest < version - self.alpha:
            self.refused_stale += 1
            return False, f"stale: a trajectory started at version {oldest}, the policy is at {version}"
        self._groups.append(group)
        self.accepted += 1
        self._changed.set()
        return True, ""

    def drop_stale(self, version: int) -> list[GroupDone]:
        """Remove and return the groups that `version` makes too old."""
        keep: collections.deque[GroupDone] = collections.deque()
        dropped: list[GroupDone] = []
        for group in self._groups:
            (dropped if started_at(group) < version - self.alpha else keep).append(group)
        self._groups = keep
        self.dropped_stale += len(dropped)
        return dropped

    async def take(self) -> list[GroupDone]:
        """Wait for `batch_groups` groups and return them, oldest first."""
        while len(self._groups) < self.batch_groups:
            self._changed.clear()
            await self._changed.wait()
        batch = [self._groups.popleft() for _ in range(self.batch_groups)]
        self.taken += len(batch)
        return batch

    def peek(self) -> list[GroupDone]:
        """The groups buffered now, oldest first (not removed)."""
        return list(self._groups)

    def stats(self) -> dict[str, int]:
        return {
            "depth": len(self._groups),
            "accepted": self.accepted,
            "refused_stale": self.refused_stale,
            "dropped_stale": self.dropped_stale,
            "taken": self.taken,
        }
