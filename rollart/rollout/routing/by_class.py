"""Class routing (`rollout.routing: class`, the default): the paper's route for a call.

1. **hardware affinity**: the task's profile picks the class: prefill-heavy -> `compute`
   generators, decode-heavy -> `bandwidth` ones (`CLASS_FOR`). The profile starts as the topology
   (or the environment) says and is then *measured* (`TaskProfiler`): prompt tokens per generated
   token, per task;
2. **failover**: when no generator of that class is usable, any generator will do (the proxy first
   waits a while for a class whose sessions are all still connecting, as at start-up);
3. **stickiness**: a trajectory stays on the generator of its previous turn (its prefix is cached
   there) unless that one has `STICKY_SLACK` more calls in flight than the least busy;
4. **least loaded**: otherwise the generator with the fewest calls in flight from this env-host,
   or, in a class of more than `EXACT_POOL` generators, the less loaded of two drawn at random.

`routing: disaggregated` routes each half of a turn this way (the prefill half wanting `compute`, the
decode half `bandwidth`), and finish-time routing routes a task this way until one of its calls is measured.
"""

from __future__ import annotations

from collections.abc import Callable

from rollart.rollout.routing.base import GeneratorRef, Pool, least_loaded

STICKY_SLACK = 2
"""A sticky generator is kept while it has at most this many more calls in flight than the least busy."""


class ClassRouter:
    """Routes a call to its preferred hardware class, sticky, least loaded, failing over to any class."""

    def __init__(self, pool: Pool, sticky: dict[str, str]) -> None:
        self.pool = pool
        self.sticky = sticky
        """Per trajectory: the generator its previous turn ran on (the proxy's, read here)."""

    def pick(
        self, trajectory_id: str, task: str, want: str, usable: Callable[[GeneratorRef], bool]
    ) -> GeneratorRef | None:
        # The wanted class first; every generator only when none of it is usable (failover).
        failover = False
        best = least_loaded(self.pool.by_class.get(want, []), usable)
        if best is None:
            failover, best = True, least_loaded(self.pool.generators, usable)
            if best is None:
                return None
        sticky = self.pool.by_name.get(self.sticky.get(trajectory_id, ""))
        if (
            sticky is not None
            and (failover or sticky.hardware == want)
            and usable(sticky)
            and sticky.in_flight <= best.in_flight + STICKY_SLACK
        ):
            return sticky
        return best

    def record(self, generator: GeneratorRef, task: str, service_s: float, now: float) -> None:
        """Nothing: class routing goes by calls in flight, not by how long calls took."""

    def describe(self) -> dict[str, object]:
        # Class routing never leaves a class it can use, nor explores: finish-time routing's keys, at zero,
        # so that a status reads the same whatever the routing.
        return {"spill": dict.fromkeys(self.pool.classes, 0.0), "overruled": 0, "explored": 0}
