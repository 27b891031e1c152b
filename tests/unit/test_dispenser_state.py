"""The dispenser's checkpoint state: a trainer that resumes from a checkpoint re-runs every group
not trained on yet, then draws the tasks and seeds the original would have drawn, under group ids
that cannot be mistaken for ids handed out before the restart.

The state goes through pickle, as it does in the trainer's checkpoint (`torch.save`).
"""

from __future__ import annotations

import pickle
from typing import Any

from rollart.protocol.messages import GroupTask
from rollart.rollout.config import RolloutSpec, TaskSpec
from rollart.rollout.dispenser import Dispenser


def spec(**overrides: object) -> RolloutSpec:
    base: dict[str, object] = {
        "tasks": [
            TaskSpec(name="a", env="copy-reverse"),
            TaskSpec(name="b", env="frozen-lake", weight=3.0),
            TaskSpec(name="c", env="sokoban", weight=2.0),
        ],
        "group_size": 2,
        "batch_groups": 2,
        "alpha": 1000,  # admission never blocks unless a test lowers it
        "lookahead": "alpha",
        "seed": 7,
    }
    return RolloutSpec(**(base | overrides))  # type: ignore[arg-type]


async def grants(dispenser: Dispenser, n: int) -> list[GroupTask]:
    out = []
    for _ in range(n):
        task = await dispenser.grant("env-0", 5, wait_s=0.01)
        assert task is not None
        out.append(task)
    return out


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return pickle.loads(pickle.dumps(state))


def drawn(tasks: list[GroupTask]) -> list[tuple[str, int]]:
    return [(t.task, t.seed) for t in tasks]


async def interrupted() -> tuple[Dispenser, list[GroupTask], dict[str, Any]]:
    """A dispenser six groups in: g1, g2 trained on; g3, g4 in the buffer; g5 failed and waiting to
    be re-issued; g6 in flight. Returns it, its groups, and its state at that point."""
    original = Dispenser(spec(), buffered=lambda: 0)
    issued = await grants(original, 6)
    for group in issued[:4]:
        assert original.complete(group.group_id) is not None
    original.reissue(issued[4].group_id, "2 of 2 failed")
    buffered = [(g.task, g.seed) for g in issued[2:4]]
    return original, issued, roundtrip(original.state_dict(buffered))


async def test_unfinished_groups_run_first_then_the_draws_the_original_would_make() -> None:
    original, issued, state = await interrupted()
    restored = Dispenser(spec(), buffered=lambda: 0)
    restored.load_state(state)
    # What the original does next: the failed g5 again, then fresh draws.
    continued = await grants(original, 1 + 40)
    assert drawn(continued[:1]) == drawn(issued[4:5])
    after = await grants(restored, 4 + 40)
    # The retry queue, then the buffered groups, then the ones in flight: same task, same seed.
    assert drawn(after[:4]) == drawn([issued[4], issued[2], issued[3], issued[5]])
    assert drawn(after[4:]) == drawn(continued[1:])
    assert len({t.task for t in after[4:]}) == 3  # the draws really come from the mix's RNG
    assert len({t.seed for t in after}) == len(after)  # each unfinished group runs once
    assert {t.seed for t in issued[:2]}.isdisjoint(t.seed for t in after)  # trained-on groups do not


async def test_group_ids_carry_the_incarnation_and_never_reuse_an_earlier_id() -> None:
    original, issued, state = await interrupted()
    before_crash = await grants(original, 3)  # granted after the checkpoint, before the crash
    restored = Dispenser(spec(), buffered=lambda: 0)
    restored.load_state(state)
    assert restored.incarnation == 1
    after = await grants(restored, 7)
    ids = [t.group_id for t in after]
    assert ids == ["i1.g7-r1", "i1.g8-r1", "i1.g9-r1", "i1.g10-r1", "i1.g11", "i1.g12", "i1.g13"]
    assert set(ids).isdisjoint(t.group_id for t in [*issued, *before_crash])
    # A group from before the restart coming back is not taken for one in flight now.
    assert restored.complete(before_crash[0].group_id) is None
    assert restored.complete(issued[5].group_id) is None
    assert restored.complete("i1.g7-r1") is not None

    again = Dispenser(spec(), buffered=lambda: 0)
    again.load_state(roundtrip(restored.state_dict([])))
    assert again.incarnation == 2
    rerun = await grants(again, 7)
    assert all(t.group_id.startswith("i2.g") for t in rerun)
    assert drawn(rerun[:6]) == drawn(after[1:7])  # i1.g7 was completed; the other six run again


async def test_counters_carry_over() -> None:
    original, _, state = await interrupted()
    original.abandoned, original.requeued = 2, 3  # as if two seeds had been given up, three groups dropped
    state = roundtrip(original.state_dict([]) | {"retry": state["retry"]})
    counts = {key: original.stats()[key] for key in ("granted", "completed", "reissued", "abandoned", "requeued")}
    assert counts == {"granted": 6, "completed": 4, "reissued": 1, "abandoned": 2, "requeued": 3}
    restored = Dispenser(spec(), buffered=lambda: 0)
    restored.load_state(state)
    assert restored.stats() == {"in_flight": 0, "limit": 2002, "retry_queue": 4, **counts}
    await grants(restored, 2)
    assert (restored.granted, restored.stats()["retry_queue"]) == (8, 2)


async def test_rerun_groups_still_wait_for_admission() -> None:
    _, _, state = await interrupted()
    restored = Dispenser(spec(alpha=0), buffered=lambda: 0)  # room for 2 groups
    restored.load_state(state)
    first = await grants(restored, 2)
    assert await restored.grant("env-0", 5, wait_s=0.01) is None
    restored.complete(first[0].group_id)
    assert (await grants(restored, 1))[0].group_id == "i1.g9-r1"


async def test_every_seed_drawn_is_accounted_for_across_a_restart() -> None:
    # What rollart/testkit/harness.py checks after a run: a seed drawn is trained, owed, or given up.
    dispenser = Dispenser(spec(group_attempts=1), buffered=lambda: 0)
    first, second, third = await grants(dispenser, 3)
    dispenser.reissue(first.group_id, "every trajectory failed", failed=True)  # its only try: given up
    dispenser.complete(second.group_id)  # handed in (to be trained)
    restored = Dispenser(spec(group_attempts=1), buffered=lambda: 0)
    restored.load_state(roundtrip(dispenser.state_dict([])))
    assert restored.abandoned_seeds == [first.seed]
    state = restored.state_dict([])
    owed = {seed for _, seed, _ in state["retry"]}
    assert owed == {third.seed}  # in flight at the checkpoint: run again
    assert set(range(spec().seed * 1_000_003 + 1, state["next_seed"] + 1)) == {first.seed, second.seed, third.seed}
