"""The staleness bound and the trainer's policy version: one rule, one keeper (`rollart.rollout.staleness`,
`rollart.rollout.versions`), checked by hand, without any network."""

from __future__ import annotations

import pytest

from rollart.protocol.messages import PolicyVersion
from rollart.rollout.buffer import SampleBuffer
from rollart.rollout.dispenser import Dispenser
from rollart.rollout.staleness import StalenessBound
from rollart.rollout.versions import PolicyVersions
from tests.unit.test_rollout_core import group, spec


@pytest.mark.parametrize(("alpha", "version", "oldest"), [(0, 5, 5), (1, 5, 4), (2, 5, 3), (2, 1, -1)])
def test_the_bound_admits_starts_from_version_minus_alpha_on(alpha: int, version: int, oldest: int) -> None:
    bound = StalenessBound(alpha)
    assert bound.oldest_start(version) == oldest
    assert bound.admits(oldest, version) and not bound.admits(oldest - 1, version)
    assert bound.oldest_weights(version) == max(0, oldest)  # no generator holds a version below 0


def keeper(alpha: int) -> tuple[PolicyVersions, SampleBuffer, Dispenser, list[PolicyVersion]]:
    bound = StalenessBound(alpha)
    buffer = SampleBuffer(batch_groups=2, bound=bound)
    dispenser = Dispenser(spec(alpha=alpha, batch_groups=2, lookahead="alpha"), buffered=lambda: len(buffer))
    told: list[PolicyVersion] = []

    async def announce(notice: PolicyVersion) -> None:
        told.append(notice)

    return PolicyVersions(bound, buffer, dispenser, announce), buffer, dispenser, told


async def test_a_taken_batch_drops_and_announces_what_the_next_version_leaves_stale_then_the_step_makes_it() -> None:
    versions, buffer, dispenser, told = keeper(alpha=1)
    versions.resume(3)
    assert buffer.put(group("old", 2, 3), 3)[0] and buffer.put(group("new", 3), 3)[0]  # both admissible at 3
    await versions.foresee()  # the batch after this one is taken at 4: a start at 2 is too old for it
    assert dispenser.training and versions.next_batch_version == 4
    assert [g.group_id for g in buffer.peek()] == ["new"]
    assert dispenser.requeued == 1 and buffer.dropped_stale == 1  # its task and seed run again
    await versions.advance()
    assert versions.version == 4 and not dispenser.training
    # the same oldest start both times, by one formula: the version the next batch is taken at, minus alpha
    assert told == [PolicyVersion(3, 3), PolicyVersion(4, 3)]
    await versions.finish()
    assert told[-1] == PolicyVersion(4, 5, done=True)


async def test_versions_only_increase_a_trainer_behind_its_generators_jumps_above_them() -> None:
    versions, _, _, told = keeper(alpha=2)
    versions.resume(5)
    versions.jump_above(3)  # generators behind the checkpoint: nothing moves
    assert versions.version == 5
    versions.jump_above(7)  # a generator holds a version this trainer never saved: its weights become 8
    assert versions.version == 8
    await versions.announce()
    assert told == [PolicyVersion(8, 6)]


async def test_alpha_0_drops_every_buffered_group_at_each_new_version() -> None:
    versions, buffer, dispenser, told = keeper(alpha=0)
    assert buffer.put(group("a", 0), 0)[0]
    await versions.foresee()
    assert buffer.peek() == [] and dispenser.requeued == 1
    assert told == [PolicyVersion(0, 1)]  # nothing started at 0 may fill the batch taken at 1
