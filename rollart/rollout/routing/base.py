"""What every routing policy shares: the generators as one env-host sees them, the task profiler, the
`Router` interface, and the draws a pick makes.

A pick must cost the same however many generators there are: in a pool of more than `EXACT_POOL`
generators it looks at two drawn at random (the "power of two choices": the load stays nearly as even
as with a full scan), and at every one only when neither drawn is usable.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rollart.protocol import Session
from rollart.protocol.messages import Generated
from rollart.rollout.config import Profile

CLASS_FOR: dict[Profile, str] = {"prefill-heavy": "compute", "decode-heavy": "bandwidth"}
"""The hardware class each task profile prefers: prefill is compute-bound, decode bandwidth-bound."""
MIN_SAMPLES = 4
"""Calls of a task measured before its measured profile replaces the configured one."""
EXACT_POOL = 8
"""Up to this many generators in a pool, a pick scans them all for the least loaded; beyond, it draws two."""
EWMA_WEIGHT = 0.2
"""Weight of the newest call in a service-time mean."""


@dataclass
class GeneratorRef:
    """A generator as one env-host sees it."""

    name: str
    hardware: str
    session: Session
    in_flight: int = 0
    failures: int = 0
    avoid_until: float = 0.0
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    """Calls served, by the task profile they were routed as (a disaggregated turn: its decode half)."""
    prefills: int = 0
    """Prefill halves of disaggregated turns served (`routing: disaggregated`)."""
    service_s: dict[str, float] = field(default_factory=dict)
    """Per task: mean seconds its calls took here once started (exponentially weighted)."""
    mean_service_s: float = 0.0
    """The same over every task."""
    running: int = 0
    """Requests running on the generator, as its last reply to this env-host said."""
    waiting: int = 0
    """Requests queued on it, not yet started, as its last reply said."""
    busy: float | None = None
    """Its recent busy fraction, as its last reply said (None: never said)."""
    sent_since_report: int = 0
    """Calls sent to it from here since that reply."""
    reported_at: float = 0.0
    """When that reply came (the loop's clock)."""

    def record(self, task: str, service_s: float, result: Generated, now: float) -> None:
        """What a finished call measured: its service time, and the load the generator reported."""
        self.service_s[task] = ewma(self.service_s.get(task), service_s)
        self.mean_service_s = ewma(self.mean_service_s or None, service_s)
        self.running, self.waiting, self.sent_since_report = result.running, result.waiting, 0
        self.reported_at = now
        if result.busy is not None:
            self.busy = result.busy

    def backlog_s(self, now: float) -> float:
        """Predicted wait before a call sent now starts here: the queue its last reply reported, worked
        off since at the rate its running requests finish (Little's law), and the calls sent here since,
        which joined that queue if any of it is left."""
        per_call = self.mean_service_s / max(1, self.running)
        left = max(0.0, self.waiting * per_call - (now - self.reported_at))
        return left + self.sent_since_report * per_call if left > 0 else 0.0


class Pool:
    """Every generator one env-host routes to, indexed the ways picks read them; fixed once built."""

    def __init__(self, generators: list[GeneratorRef]) -> None:
        self.generators = generators
        self.by_name = {generator.name: generator for generator in generators}
        by_class: dict[str, list[GeneratorRef]] = collections.defaultdict(list)
        for generator in generators:
            by_class[generator.hardware].append(generator)
        self.by_class = dict(by_class)
        self.classes = list(dict.fromkeys([*self.by_class, *CLASS_FOR.values()]))
        """Every class with a generator, and every class a profile prefers (it may have none)."""
        self.outside = {hardware: [g for g in generators if g.hardware != hardware] for hardware in self.classes}
        """Per class, the generators of every other class (the candidates that overrule a preference)."""


class Router(Protocol):
    """A routing policy: which generator takes one call. `LLMProxy` builds one from `rollout.routing`
    (given the pool and where each trajectory's previous turn ran, which the proxy keeps) and sends,
    re-issues and fails over around its picks."""

    def pick(
        self, trajectory_id: str, task: str, want: str, usable: Callable[[GeneratorRef], bool]
    ) -> GeneratorRef | None:
        """The generator for the next call of `trajectory_id`, of `task`, whose profile prefers hardware
        class `want`, among those `usable` allows; None when none is. Asked once per call sent, so
        it costs the same at any pool size."""
        ...

    def record(self, generator: GeneratorRef, task: str, service_s: float, now: float) -> None:
        """A whole call of `task` took `service_s` on `generator` once started (`now`: the loop's clock);
        `generator.record` has taken the load it reported."""
        ...

    def describe(self) -> dict[str, object]:
        """The router's part of the proxy's status."""
        ...


class TaskProfiler:
    """Measures each task's prompt-to-generated token ratio and classifies it."""

    def __init__(self, initial: dict[str, Profile], ratio: float) -> None:
        self.initial = initial
        self.ratio = ratio
        self.prompt_tokens: collections.Counter[str] = collections.Counter()
        self.generated_tokens: collections.Counter[str] = collections.Counter()
        self.samples: collections.Counter[str] = collections.Counter()

    def record(self, task: str, prompt_tokens: int, generated_tokens: int) -> None:
        self.prompt_tokens[task] += prompt_tokens
        self.generated_tokens[task] += generated_tokens
        self.samples[task] += 1

    def profile(self, task: str) -> Profile:
        if self.samples[task] < MIN_SAMPLES:
            return self.initial.get(task, "decode-heavy")
        measured = self.prompt_tokens[task] / max(1, self.generated_tokens[task])
        return "prefill-heavy" if measured > self.ratio else "decode-heavy"

    def describe(self) -> dict[str, dict[str, object]]:
        return {
            task: {
                "profile": self.profile(task),
                "configured": self.initial.get(task),
                "prompt_per_generated": round(self.prompt_tokens[task] / max(1, self.generated_tokens[task]), 2),
                "samples": self.samples[task],
            }
            for task in sorted(set(self.initial) | set(self.samples))
        }


def loop_time() -> float:
    """The running loop's clock (simulated time in the in-process simulations), else the monotonic one."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def ewma(mean: float | None, value: float) -> float:
    """`mean` moved toward `value` by `EWMA_WEIGHT` (`value` itself when there is no mean yet)."""
    return value if mean is None else mean + EWMA_WEIGHT * (value - mean)


def drawn(pool: list[GeneratorRef], usable: Callable[[GeneratorRef], bool]) -> list[GeneratorRef]:
    """The usable generators of `pool` to score: all of a pool of up to `EXACT_POOL`, else two drawn at
    random (scanning for usable ones only when neither drawn is)."""
    if len(pool) > EXACT_POOL:
        two = [g for g in random.sample(pool, 2) if usable(g)]
        if two:
            return two
    return [g for g in pool if usable(g)]


def least_loaded(pool: list[GeneratorRef], usable: Callable[[GeneratorRef], bool]) -> GeneratorRef | None:
    """The usable generator of `pool` with the fewest calls in flight (ties broken at random); in a
    pool larger than `EXACT_POOL`, the less loaded of two drawn at random, scanning only if neither
    of them is usable."""
    candidates = drawn(pool, usable)
    if not candidates:
        return None
    least = min(g.in_flight for g in candidates)
    return random.choice([g for g in candidates if g.in_flight == least])
