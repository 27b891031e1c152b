"""Finish-time routing (`rollout.routing: finish-time`): a call goes to the generator where it is
predicted to **finish first**:

    finish(g) = service(g, task) + backlog(g) * mean service(g) / running(g)

- `service(g, task)`: how long this task's calls took on `g` once started, measured by the proxy (an
  exponentially weighted mean of the call's time minus the `queued_s` the generator reports);
  unmeasured on `g`: the mean of the task on `g`'s hardware class. A class the task has never run on
  is tried once (its estimate is the task's mean elsewhere, so the first call that finds its own class
  slower goes there and measures it), and `EXPLORE` of the calls go to a random candidate so that
  every class's means stay current: a class slowed by its own load (a continuous-batching engine
  admits everything and decodes slower, rather than queueing) is seen as slow only against a
  measurement of the others;
- `backlog(g)`: requests queued on `g` (not yet started) as its last reply reported, plus the calls
  sent to it since, at the rate it works them off (Little's law over its running requests,
  `GeneratorRef.backlog_s`);
- **hardware class** is a preference the estimate overrules only where that pays: a call's candidates
  are its preferred class's generators, and those of the other classes with room (no queue, not
  `SATURATED`) when every one of its own has a queue, or all of the others' (a fraction of its calls
  that the spill controller moves, `spill`) when the class is saturated while another has room.
  Off-class estimates are also `OFF_CLASS` longer, so the class wins near-ties;
- **stickiness**: a trajectory stays on the generator of its previous turn (its prefix is cached
  there) while that one's estimate is within `STICKY_MARGIN` of the best;
- **candidates**: every generator of a class of up to `EXACT_POOL`, else two drawn at random, from
  the preferred class and from the others, and the sticky one: a pick costs the same at any size.

A task without a measured call has nothing to estimate from: it is routed by class (`by_class`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from rollart.rollout.routing.base import GeneratorRef, Pool, drawn, ewma, loop_time
from rollart.rollout.routing.by_class import ClassRouter
from rollart.rollout.routing.spill import SATURATED, SpillController

OFF_CLASS = 1.1
"""Estimates off a task's preferred class are this much longer: the class its profile prefers wins near-ties."""
EXPLORE = 0.02
"""Fraction of finish-time picks that go to a random candidate instead of the best: measurements of every
class stay current."""
STICKY_MARGIN = 0.25
"""A sticky generator is kept while its predicted finish is within this fraction of the best one's."""


class FinishTimeRouter:
    """Routes a call where it is predicted to finish first, preferring its class; by class until measured."""

    def __init__(self, pool: Pool, sticky: dict[str, str]) -> None:
        self.pool = pool
        self.sticky = sticky
        """Per trajectory: the generator its previous turn ran on (the proxy's, read here)."""
        self.unmeasured = ClassRouter(pool, sticky)
        """The route of a task with no measured call yet."""
        self.spill = SpillController(pool)
        self.class_service_s: dict[tuple[str, str], float] = {}
        """Per (task, hardware class): mean service seconds of the task's calls on that class."""
        self.task_service_s: dict[str, float] = {}
        """Per task: mean service seconds anywhere."""
        self.overruled = 0
        """Calls sent outside their preferred class while it had a usable generator."""
        self.explored = 0
        """Calls sent to a random candidate (`EXPLORE`)."""

    def estimate_s(self, g: GeneratorRef, task: str, want: str, now: float) -> float:
        """Predicted seconds until a call of `task` sent at `now` (the loop's clock) would finish on `g`
        (the task has a measured call)."""
        service = g.service_s.get(task)
        if service is None:
            service = self.class_service_s.get((task, g.hardware))
        if service is None:  # never run on this class: as fast as anywhere until one call says otherwise
            service = self.task_service_s[task]
        return (service + g.backlog_s(now)) * (1.0 if g.hardware == want else OFF_CLASS)

    def pick(
        self, trajectory_id: str, task: str, want: str, usable: Callable[[GeneratorRef], bool]
    ) -> GeneratorRef | None:
        if task not in self.task_service_s:
            return self.unmeasured.pick(trajectory_id, task, want, usable)
        now = loop_time()
        candidates = drawn(self.pool.by_class.get(want, []), usable)
        if not candidates or random.random() < self.spill.fractions[want]:
            candidates += drawn(self.pool.outside[want], usable)
        elif all(g.backlog_s(now) > 0 for g in candidates):  # the class queues: others with room may take it
            candidates += [g for g in drawn(self.pool.outside[want], usable) if has_room(g, now)]
        if not candidates:
            return None
        if len(candidates) > 1 and random.random() < EXPLORE:
            best = random.choice(candidates)
            self.explored += 1
            if best.hardware != want and self.pool.by_class.get(want):
                self.overruled += 1
            return best
        scored = [(self.estimate_s(g, task, want, now), g.in_flight, random.random(), g) for g in candidates]
        best_s, _, _, best = min(scored, key=lambda entry: entry[:3])
        sticky = self.pool.by_name.get(self.sticky.get(trajectory_id, ""))
        near = best_s * (1 + STICKY_MARGIN)
        if sticky is not None and usable(sticky) and self.estimate_s(sticky, task, want, now) <= near:
            best = sticky
        if best.hardware != want and self.pool.by_class.get(want):
            self.overruled += 1
        return best

    def record(self, generator: GeneratorRef, task: str, service_s: float, now: float) -> None:
        key = (task, generator.hardware)
        self.class_service_s[key] = ewma(self.class_service_s.get(key), service_s)
        self.task_service_s[task] = ewma(self.task_service_s.get(task), service_s)
        self.spill.observe(now)

    def describe(self) -> dict[str, object]:
        return {"spill": self.spill.describe(), "overruled": self.overruled, "explored": self.explored}


def has_room(g: GeneratorRef, now: float) -> bool:
    """Whether `g` would start a call at once and is not saturated: a backlogged class's calls may go there
    (to a busy one, a continuous-batching engine that slows everything it runs, they would not)."""
    return g.backlog_s(now) == 0 and (g.busy is None or g.busy < SATURATED)
