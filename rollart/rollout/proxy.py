"""LLMProxy: where each generation call of a trajectory goes, in the env-host.

The route for one call, in order:
1. **hardware affinity**: the task's profile picks the class: prefill-heavy -> `compute`
   generators, decode-heavy -> `bandwidth` ones. The profile starts as the topology (or the
   environment) says and is then *measured*: prompt tokens per generated token, per task;
2. **failover**: when no generator of that class is up, any generator will do (but a class whose
   sessions are all still connecting, as at start-up, is waited for up to `CONNECT_WAIT_S` first);
3. **stickiness**: a trajectory stays on the generator of its previous turn (its prefix is
   cached there) unless that one is much busier than the least busy;
4. **least loaded**: otherwise the generator with the fewest calls in flight from this env-host,
   or, in a class of more than `EXACT_POOL` generators, the less loaded of two drawn at random
   (the "power of two choices": a pick costs the same however large the cluster, and the load stays
   nearly as even as with a full scan).

A call that times out, or whose generator's session drops, is re-issued on another generator
after a full-jitter backoff; a generator that failed is avoided for a short cool-down.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from rollart.errors import RollartError
from rollart.protocol import Session, State
from rollart.protocol.errors import RemoteError, RequestTimeout, SessionLost, UnexpectedReply
from rollart.protocol.messages import Generate, Generated
from rollart.protocol.retry import Backoff
from rollart.rollout.config import Profile

log = structlog.get_logger("rollart.rollout.proxy")

CLASS_FOR: dict[Profile, str] = {"prefill-heavy": "compute", "decode-heavy": "bandwidth"}
STICKY_SLACK = 2
"""A sticky generator is kept while it has at most this many more calls in flight than the least busy."""
COOL_DOWN_S = 2.0
CONNECT_WAIT_S = 30.0
"""How long a call waits for a hardware class whose sessions have never come up before failing over."""
MIN_SAMPLES = 4
EXACT_POOL = 8
"""Up to this many generators in a pool, a pick scans them all for the least loaded; beyond, it draws two."""


class GenerationFailed(RollartError):
    """Every attempt to generate a turn failed."""


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
    """Calls served, by the task profile they were routed as."""


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


class LLMProxy:
    """Routes generation calls to generators; re-issues them when a generator fails."""

    def __init__(
        self,
        generators: list[GeneratorRef],
        profiler: TaskProfiler,
        *,
        timeout_s: float,
        attempts: int = 6,
        backoff_base_s: float = 0.1,
        backoff_cap_s: float = 2.0,
    ) -> None:
        self.generators = generators
        self.by_name = {generator.name: generator for generator in generators}
        self.by_class: dict[str, list[GeneratorRef]] = collections.defaultdict(list)
        for generator in generators:
            self.by_class[generator.hardware].append(generator)
        self._started: set[str] = set()
        """Classes with a generator past its first connection: no start-up wait for them again."""
        self.profiler = profiler
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff = Backoff(backoff_base_s, backoff_cap_s)  # full jitter
        self.sticky: dict[str, str] = {}
        self.reissued = 0
        self.cancelled = 0

    def _pick(self, trajectory_id: str, want: str, excluded: set[str]) -> GeneratorRef | None:
        now = time.monotonic()

        def usable(g: GeneratorRef) -> bool:
            return g.session.state is State.UP and g.avoid_until <= now and g.name not in excluded

        # The wanted class first; every generator only when none of it is usable (failover).
        failover = False
        best = _least_loaded(self.by_class.get(want, []), usable)
        if best is None:
            failover, best = True, _least_loaded(self.generators, usable)
            if best is None:
                return None
        sticky = self.by_name.get(self.sticky.get(trajectory_id, ""))
        if (
            sticky is not None
            and (failover or sticky.hardware == want)
            and usable(sticky)
            and sticky.in_flight <= best.in_flight + STICKY_SLACK
        ):
            return sticky
        return best

    async def _first_connection(self, want: str) -> None:
        """Wait (bounded) while every generator of class `want` is still making its first connection."""
        if want in self._started:  # the common case: checked once per call, so kept O(1)
            return
        mine = self.by_class.get(want, [])
        if not mine or any(g.session.state is not State.CONNECTING for g in mine):
            self._started.add(want)  # a session never goes back to CONNECTING
            return
        waits = [asyncio.ensure_future(g.session.up.wait()) for g in mine]
        try:
            await asyncio.wait(waits, timeout=CONNECT_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def generate(self, task: str, request: Generate) -> Generated:
        """Generate one turn of a trajectory, on the best generator that answers."""
        profile = self.profiler.profile(task)
        want = CLASS_FOR[profile]
        await self._first_connection(want)
        excluded: set[str] = set()
        last_error = "no generator is up"
        for attempt in range(self.attempts):
            generator = self._pick(request.trajectory_id, want, excluded)
            if generator is None:
                excluded.clear()  # every one failed once: try them again after the backoff
            else:
                generator.in_flight += 1
                try:
                    result = await self._call(generator, request)
                except (RequestTimeout, SessionLost, RemoteError, UnexpectedReply, _Down) as exc:
                    last_error = f"{generator.name}: {exc}"
                    generator.failures += 1
                    generator.avoid_until = time.monotonic() + COOL_DOWN_S
                    excluded.add(generator.name)
                    self.reissued += 1
                    log.warning(
                        "proxy.reissue", trajectory=request.trajectory_id, generator=generator.name, error=str(exc)
                    )
                else:
                    self.sticky[request.trajectory_id] = generator.name
                    generator.calls[profile] += 1
                    self.profiler.record(task, result.prompt_tokens, len(result.token_ids))
                    return result
                finally:
                    generator.in_flight -= 1
            await asyncio.sleep(self.backoff.delay(attempt))
        raise GenerationFailed(f"turn of {request.trajectory_id} failed {self.attempts} times; last: {last_error}")

    async def _call(self, generator: GeneratorRef, request: Generate) -> Generated:
        """The request, abandoned at once if the generator's session drops meanwhile."""
        call = asyncio.ensure_future(generator.session.request(request, timeout=self.timeout_s))
        down = asyncio.ensure_future(generator.session.down.wait())
        try:
            try:
                await asyncio.wait([call, down], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                self.cancelled += 1  # the trajectory was cancelled: the generator is told to abort
                raise
            if not call.done():
                raise _Down(f"session to {generator.name} dropped")
            return call.result()
        finally:
            call.cancel()
            down.cancel()

    def forget(self, trajectory_id: str) -> None:
        self.sticky.pop(trajectory_id, None)

    def describe(self) -> dict[str, object]:
        return {
            "generators": {
                g.name: {
                    "hardware": g.hardware,
                    "up": g.session.state is State.UP,
                    "in_flight": g.in_flight,
                    "failures": g.failures,
                    "calls": dict(g.calls),
                }
                for g in self.generators
            },
            "tasks": self.profiler.describe(),
            "reissued": self.reissued,
            "cancelled": self.cancelled,
        }


def _least_loaded(pool: list[GeneratorRef], usable: Callable[[GeneratorRef], bool]) -> GeneratorRef | None:
    """The usable generator of `pool` with the fewest calls in flight (ties broken at random); in a
    pool larger than `EXACT_POOL`, the less loaded of two drawn at random, scanning only if neither
    of them is usable."""
    if len(pool) > EXACT_POOL:
        drawn = [g for g in random.sample(pool, 2) if usable(g)]
        if drawn:
            return min(drawn, key=lambda g: g.in_flight)
    candidates = [g for g in pool if usable(g)]
    if not candidates:
        return None
    least = min(g.in_flight for g in candidates)
    return random.choice([g for g in candidates if g.in_flight == least])


class _Down(RollartError):
    """The generator's session dropped while a call was in flight."""
