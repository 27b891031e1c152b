"""LLMProxy's pick of a generator for one call: class, failover, stickiness, least loaded, and what
a pick costs in a large class (two generators looked at, not all of them)."""

from __future__ import annotations

import collections
import statistics
from typing import cast

from rollart.protocol import Session, State
from rollart.rollout.proxy import EXACT_POOL, STICKY_SLACK, GeneratorRef, LLMProxy, TaskProfiler


class Looked:
    """The one thing a pick reads of a session: its state; counts how often it was read."""

    reads = 0

    def __init__(self, up: bool = True) -> None:
        self._state = State.UP if up else State.CONNECTING

    @property
    def state(self) -> State:
        Looked.reads += 1
        return self._state


def generators(hardware: str, loads: list[int], *, up: bool = True, prefix: str = "") -> list[GeneratorRef]:
    return [
        GeneratorRef(f"{prefix or hardware}-{i}", hardware, cast(Session, Looked(up)), in_flight=load)
        for i, load in enumerate(loads)
    ]


def proxy(refs: list[GeneratorRef]) -> LLMProxy:
    return LLMProxy(refs, TaskProfiler({}, ratio=4.0), timeout_s=1.0)


def picks(p: LLMProxy, want: str, n: int = 200, trajectory: str = "t") -> collections.Counter[str]:
    chosen = collections.Counter[str]()
    for _ in range(n):
        g = p._pick(trajectory, want, set())
        chosen[g.name if g else "none"] += 1
    return chosen


def test_a_call_goes_to_its_class_and_to_the_least_loaded_there() -> None:
    p = proxy(generators("compute", [0, 0]) + generators("bandwidth", [3, 1, 1, 2]))
    assert set(picks(p, "bandwidth")) == {"bandwidth-1", "bandwidth-2"}  # ties broken at random: both
    assert set(picks(p, "compute")) == {"compute-0", "compute-1"}


def test_a_class_with_none_up_fails_over_to_any_generator() -> None:
    p = proxy(generators("compute", [0, 0], up=False) + generators("bandwidth", [2, 5]))
    assert set(picks(p, "compute")) == {"bandwidth-0"}
    p = proxy(generators("compute", [0], up=False))
    assert set(picks(p, "compute")) == {"none"}


def test_a_trajectory_stays_on_its_generator_until_that_one_is_much_busier() -> None:
    refs = generators("compute", [0, 0, 0])
    p = proxy(refs)
    p.sticky["t"] = "compute-2"
    refs[2].in_flight = STICKY_SLACK
    assert set(picks(p, "compute")) == {"compute-2"}
    refs[2].in_flight = STICKY_SLACK + 1
    assert set(picks(p, "compute")) == {"compute-0", "compute-1"}
    # Not kept outside the class wanted (the task's measured profile changed) unless failing over.
    p = proxy(refs + generators("bandwidth", [0]))
    p.sticky["t"] = "bandwidth-0"
    assert "bandwidth-0" not in picks(p, "compute")


def test_a_pick_in_a_large_class_looks_at_two_generators_and_avoids_the_busy_ones() -> None:
    n = 1000
    loads = [i % 50 for i in range(n)]
    p = proxy(generators("compute", loads))
    Looked.reads = 0
    chosen = picks(p, "compute", n=2000, trajectory="")
    assert Looked.reads <= 2 * 2000  # two looked at per pick, however large the class
    picked = [load for name, count in chosen.items() for load in [loads[int(name.rsplit("-", 1)[1])]] * count]
    # The less loaded of two: about 16 on average where a random pick gets the pool's mean (24.5); the
    # busiest only when both drawn are the busiest (1 in 2,500).
    assert statistics.fmean(picked) < statistics.fmean(loads) - 6, statistics.fmean(picked)
    assert picked.count(49) < 10


def test_a_large_class_whose_drawn_generators_are_down_still_finds_one_up() -> None:
    down = generators("compute", [0] * (EXACT_POOL * 4), up=False)
    up = generators("compute", [7], prefix="alive")
    p = proxy(down + up)
    assert set(picks(p, "compute", n=50)) == {"alive-0"}


def test_state_reads_are_what_a_pick_looks_at() -> None:
    """The fake session above counts what `_pick` reads; a guard that the count means something."""
    p = proxy(generators("compute", [0, 1, 2]))
    Looked.reads = 0
    p._pick("t", "compute", set())
    assert Looked.reads == 3  # a small class: every generator is looked at
