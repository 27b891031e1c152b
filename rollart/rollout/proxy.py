"""LLMProxy: where each generation call of a trajectory goes, in the env-host.

With `rollout.routing: finish-time` a call goes to the generator where it is predicted to
**finish first** (the default, `class`, is the paper's routing, further below):

    finish(g) = service(g, task) + backlog(g) * mean service(g) / running(g)

- `service(g, task)`: how long this task's calls took on `g` once started, measured here (an
  exponentially weighted mean of the call's time minus the `queued_s` the generator reports);
  unmeasured on `g`: the mean of the task on `g`'s hardware class. A class the task has never run on
  is tried once (its estimate is the task's mean elsewhere, so the first call that finds its own class
  slower goes there and measures it), and `EXPLORE` of the calls go to a random candidate so that
  every class's means stay current: a class slowed by its own load (a continuous-batching engine
  admits everything and decodes slower, rather than queueing) is seen as slow only against a
  measurement of the others;
- `backlog(g)`: requests queued on `g` (not yet started) as its last reply reported, plus the calls
  sent to it since, at the rate it works them off (Little's law over its running requests);
- **hardware class** is a preference the estimate overrules only where that pays: a call's candidates
  are its preferred class's generators, and those of the other classes with room (no queue, not
  `SATURATED`) when every one of its own has a queue, or all of the others' (a fraction `spill` of its
  calls) when the class is saturated while another has room.
  A continuous-batching engine does not queue when loaded, it slows down, and a call routed to the
  generator that finishes it first (measured: routing every call by finish time) takes decode work
  to the class that is quick at it while lightly loaded and costly per token, which a class routing
  kept balanced would not (paper shape 48 H800 + 72 H20: 1.27x -> 1.07x). So each class's `spill`
  follows the recent busy fractions the generators report with each reply: up by `SPILL_STEP` every
  `SPILL_EVERY_S` while the class is `SATURATED` and another is `SPILL_GAP` less busy, down once the
  two are within `SPILL_HOLD` (or it has room itself). Off-class estimates are also `OFF_CLASS`
  longer, so the class wins near-ties;
- **stickiness**: a trajectory stays on the generator of its previous turn (its prefix is cached
  there) while that one's estimate is within `STICKY_MARGIN` of the best;
- **candidates**: every generator of a class of up to `EXACT_POOL`, else two drawn at random, from
  the preferred class and from the others, and the sticky one: a pick costs the same at any size.

Before a task has a measured call, and with `routing: class`, the route is the paper's:
1. **hardware affinity**: the task's profile picks the class: prefill-heavy -> `compute`
   generators, decode-heavy -> `bandwidth` ones. The profile starts as the topology (or the
   environment) says and is then *measured*: prompt tokens per generated token, per task;
2. **failover**: when no generator of that class is up, any generator will do (but a class whose
   sessions are all still connecting, as at start-up, is waited for up to `CONNECT_WAIT_S` first);
3. **stickiness**: a trajectory stays on the generator of its previous turn unless that one has
   `STICKY_SLACK` more calls in flight than the least busy;
4. **least loaded**: otherwise the generator with the fewest calls in flight from this env-host,
   or, in a class of more than `EXACT_POOL` generators, the less loaded of two drawn at random
   (the "power of two choices": a pick costs the same however large the cluster, and the load stays
   nearly as even as with a full scan).

A call that times out, or whose generator's session drops, is re-issued on another generator
after a full-jitter backoff; a generator that failed is avoided for a short cool-down. A call
whose session drops while no other generator is up waits for that session instead (it resumes
with the call, nothing lost or run twice), and while no generator is up at all, a call waits for
one, up to its timeout, without using an attempt.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from rollart.errors import RollartError
from rollart.protocol import Session, State
from rollart.protocol.errors import RemoteError, RequestTimeout, SessionLost, UnexpectedReply
from rollart.protocol.messages import Generate, Generated
from rollart.protocol.retry import Backoff
from rollart.rollout.config import Profile, Routing

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
EWMA_WEIGHT = 0.2
"""Weight of the newest call in a service-time mean."""
OFF_CLASS = 1.1
"""Estimates off a task's preferred class are this much longer: the class its profile prefers wins near-ties."""
EXPLORE = 0.02
"""Fraction of finish-time picks that go to a random candidate instead of the best: measurements of every
class stay current."""
STICKY_MARGIN = 0.25
"""A sticky generator is kept while its predicted finish is within this fraction of the best one's."""
SATURATED = 0.9
"""A hardware class this busy (its generators' recent busy fraction, on average) has no room to spare."""
SPILL_GAP = 0.15
"""Calls spill out of a saturated class while another is at least this much less busy..."""
SPILL_HOLD = 0.05
"""...and spill less once the gap is below this (between the two, the spill holds)."""
SPILL_STEP = 0.05
SPILL_MAX = 0.9
SPILL_EVERY_S = 2.0
"""How often (the loop's clock) the spill fractions move, by `SPILL_STEP`, within 0 and `SPILL_MAX`."""


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
        self.service_s[task] = _ewma(self.service_s.get(task), service_s)
        self.mean_service_s = _ewma(self.mean_service_s or None, service_s)
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
        routing: Routing = "class",
        attempts: int = 6,
        backoff_base_s: float = 0.1,
        backoff_cap_s: float = 2.0,
    ) -> None:
        self.generators = generators
        self.by_name = {generator.name: generator for generator in generators}
        self.by_class: dict[str, list[GeneratorRef]] = collections.defaultdict(list)
        for generator in generators:
            self.by_class[generator.hardware].append(generator)
        classes = [*self.by_class, *CLASS_FOR.values()]
        self.outside = {hardware: [g for g in generators if g.hardware != hardware] for hardware in classes}
        """Per class, the generators of every other class (the candidates that overrule a preference)."""
        self.routing = routing
        self.class_service_s: dict[tuple[str, str], float] = {}
        """Per (task, hardware class): mean service seconds of the task's calls on that class."""
        self.task_service_s: dict[str, float] = {}
        """Per task: mean service seconds anywhere."""
        self.overruled = 0
        """Calls sent outside their preferred class while it had a usable generator."""
        self.explored = 0
        """Calls sent to a random candidate (`EXPLORE`)."""
        self.spill: dict[str, float] = dict.fromkeys(classes, 0.0)
        """Per hardware class: the fraction of its calls whose candidates include the other classes."""
        self._spill_moved_at = 0.0
        self._started: set[str] = set()
        """Classes with a generator past its first connection: no start-up wait for them again."""
        self.profiler = profiler
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff = Backoff(backoff_base_s, backoff_cap_s)  # full jitter
        self.sticky: dict[str, str] = {}
        self.reissued = 0
        self.cancelled = 0

    def _pick(self, trajectory_id: str, task: str, want: str, excluded: set[str]) -> GeneratorRef | None:
        now = time.monotonic()

        def usable(g: GeneratorRef) -> bool:
            return g.session.state is State.UP and g.avoid_until <= now and g.name not in excluded

        if self.routing == "finish-time" and task in self.task_service_s:
            return self._pick_first_finish(trajectory_id, task, want, usable)
        return self._pick_by_class(trajectory_id, want, usable)

    def estimate_s(self, g: GeneratorRef, task: str, want: str, now: float) -> float:
        """Predicted seconds until a call of `task` sent at `now` (the loop's clock) would finish on `g`
        (the task has a measured call)."""
        service = g.service_s.get(task)
        if service is None:
            service = self.class_service_s.get((task, g.hardware))
        if service is None:  # never run on this class: as fast as anywhere until one call says otherwise
            service = self.task_service_s[task]
        return (service + g.backlog_s(now)) * (1.0 if g.hardware == want else OFF_CLASS)

    def _pick_first_finish(
        self, trajectory_id: str, task: str, want: str, usable: Callable[[GeneratorRef], bool]
    ) -> GeneratorRef | None:
        now = _now()
        candidates = _drawn(self.by_class.get(want, []), usable)
        if not candidates or random.random() < self.spill[want]:
            candidates += _drawn(self.outside[want], usable)
        elif all(g.backlog_s(now) > 0 for g in candidates):  # the class queues: others with room may take it
            candidates += [g for g in _drawn(self.outside[want], usable) if _has_room(g, now)]
        if not candidates:
            return None
        if len(candidates) > 1 and random.random() < EXPLORE:
            best = random.choice(candidates)
            self.explored += 1
            if best.hardware != want and self.by_class.get(want):
                self.overruled += 1
            return best
        scored = [(self.estimate_s(g, task, want, now), g.in_flight, random.random(), g) for g in candidates]
        best_s, _, _, best = min(scored, key=lambda entry: entry[:3])
        sticky = self.by_name.get(self.sticky.get(trajectory_id, ""))
        near = best_s * (1 + STICKY_MARGIN)
        if sticky is not None and usable(sticky) and self.estimate_s(sticky, task, want, now) <= near:
            best = sticky
        if best.hardware != want and self.by_class.get(want):
            self.overruled += 1
        return best

    def _pick_by_class(
        self, trajectory_id: str, want: str, usable: Callable[[GeneratorRef], bool]
    ) -> GeneratorRef | None:
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
        """Generate one turn of a trajectory, on the best generator that answers; with `routing: disaggregated`,
        prefilled on a compute generator and decoded on a bandwidth one, which takes the prompt's KV cache
        from the first (each half re-issued on its own; a class with no generator up takes the whole turn
        to the other, as failover)."""
        profile = self.profiler.profile(task)
        if self.routing == "disaggregated" and await self._both_up():
            half = msgspec.structs.replace(request, request_id=f"{request.request_id}/prefill", prefill_only=True)
            prefilled = await self._generate_on(task, half, "compute", profile)
            decode = msgspec.structs.replace(request, kv_from=f"{prefilled.generator}/{prefilled.request_id}")
            return await self._generate_on(task, decode, "bandwidth", profile)
        want = CLASS_FOR[profile]
        await self._first_connection(want)
        return await self._generate_on(task, request, want, profile)

    async def _both_up(self) -> bool:
        """Whether the compute and the bandwidth class each have a generator up (after start-up's wait)."""
        for hardware in ("compute", "bandwidth"):
            await self._first_connection(hardware)
            if not any(g.session.state is State.UP for g in self.by_class.get(hardware, [])):
                return False
        return True

    async def _generate_on(self, task: str, request: Generate, want: str, profile: Profile) -> Generated:
        """`request` on the best generator of class `want` (or another, as the routing allows) that answers."""
        excluded: set[str] = set()
        last_error = "no generator is up"
        attempt = 0
        while attempt < self.attempts:
            generator = self._pick(request.trajectory_id, task, want, excluded)
            if generator is None:
                excluded.clear()  # every one failed once: try them again after the backoff
                # None up (a session reconnecting): waiting for one is no attempt, or a reconnect of the only
                # generator would use every attempt up within its backoffs and lose the trajectory.
                if not await self._one_up(self.timeout_s):
                    last_error = f"no generator came up within {self.timeout_s} s"
                    break
                await asyncio.sleep(self.backoff.delay(attempt))  # one up, in its cool-down: wait it out
                continue
            attempt += 1
            generator.in_flight += 1
            generator.sent_since_report += 1
            sent_at = _now()
            try:
                result = await self._call(generator, request)
            except (RequestTimeout, SessionLost, RemoteError, UnexpectedReply, _Down) as exc:
                last_error = f"{generator.name}: {exc}"
                generator.failures += 1
                generator.avoid_until = time.monotonic() + COOL_DOWN_S
                excluded.add(generator.name)
                self.reissued += 1
                log.warning("proxy.reissue", trajectory=request.trajectory_id, generator=generator.name, error=str(exc))
            else:
                if request.prefill_only:  # half a turn: nothing to profile, and the trajectory's prefix stays
                    generator.prefills += 1  # where it is decoded
                    return result
                self.sticky[request.trajectory_id] = generator.name
                generator.calls[profile] += 1
                self.profiler.record(task, result.prompt_tokens, len(result.token_ids))
                now = _now()
                self._record(generator, task, max(0.0, now - sent_at - result.queued_s), result, now)
                return result
            finally:
                generator.in_flight -= 1
            await asyncio.sleep(self.backoff.delay(attempt))
        raise GenerationFailed(f"turn of {request.trajectory_id} failed ({attempt} calls made); last: {last_error}")

    def _another_up(self, generator: GeneratorRef) -> bool:
        """Whether a generator other than `generator` could take a call now (scanned: only when a session drops)."""
        now = time.monotonic()
        return any(g is not generator and g.session.state is State.UP and g.avoid_until <= now for g in self.generators)

    async def _one_up(self, timeout_s: float) -> bool:
        """Whether a generator's session is up, waiting up to `timeout_s` for one to come up."""
        if any(g.session.state is State.UP for g in self.generators):
            return True
        waits = [asyncio.ensure_future(g.session.up.wait()) for g in self.generators]
        try:
            done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return bool(done)
        finally:
            for wait in waits:
                wait.cancel()

    async def _call(self, generator: GeneratorRef, request: Generate) -> Generated:
        """The request, abandoned at once if the generator's session drops meanwhile and another generator
        is up to take it; with none, the call waits on: a session that resumes delivers its answer (a
        re-sent request would find the first still in flight there), one that ends raises `SessionLost`."""
        call = asyncio.ensure_future(generator.session.request(request, timeout=self.timeout_s))
        down = asyncio.ensure_future(generator.session.down.wait())
        try:
            try:
                await asyncio.wait([call, down], return_when=asyncio.FIRST_COMPLETED)
                if not call.done() and not self._another_up(generator):
                    await asyncio.wait([call])
            except asyncio.CancelledError:
                self.cancelled += 1  # the trajectory was cancelled: the generator is told to abort
                raise
            if not call.done():
                raise _Down(f"session to {generator.name} dropped")
            return call.result()
        finally:
            call.cancel()
            down.cancel()

    def _record(self, generator: GeneratorRef, task: str, service_s: float, result: Generated, now: float) -> None:
        if result.finish_reason == "abort":
            return  # cut short: says nothing of what a whole call takes
        generator.record(task, service_s, result, now)
        key = (task, generator.hardware)
        self.class_service_s[key] = _ewma(self.class_service_s.get(key), service_s)
        self.task_service_s[task] = _ewma(self.task_service_s.get(task), service_s)
        if now - self._spill_moved_at >= SPILL_EVERY_S:
            self._spill_moved_at = now
            self._move_spill()

    def _move_spill(self) -> None:
        """Each class's spill follows how busy it is against the least busy other class: up while it is
        saturated and that one has room, down once they are near level (or it has room itself)."""
        busy = {
            hardware: sum(reports) / len(reports)
            for hardware, pool in self.by_class.items()
            if (reports := [g.busy for g in pool if g.busy is not None])
        }
        for hardware, mine in busy.items():
            others = [other for name, other in busy.items() if name != hardware]
            if not others:
                continue
            gap, spill = mine - min(others), self.spill[hardware]
            if mine >= SATURATED and gap >= SPILL_GAP:
                spill = min(SPILL_MAX, spill + SPILL_STEP)
            elif mine < SATURATED - SPILL_HOLD or gap < SPILL_HOLD:
                spill = max(0.0, spill - SPILL_STEP)
            self.spill[hardware] = spill

    def forget(self, trajectory_id: str) -> None:
        self.sticky.pop(trajectory_id, None)

    def describe(self) -> dict[str, object]:
        now = _now()
        return {
            "generators": {
                g.name: {
                    "hardware": g.hardware,
                    "up": g.session.state is State.UP,
                    "in_flight": g.in_flight,
                    "failures": g.failures,
                    "calls": dict(g.calls),
                    "prefills": g.prefills,
                    "service_s": {task: round(seconds, 3) for task, seconds in g.service_s.items()},
                    "backlog_s": round(g.backlog_s(now), 3),
                }
                for g in self.generators
            },
            "tasks": self.profiler.describe(),
            "routing": self.routing,
            "spill": {hardware: round(fraction, 3) for hardware, fraction in self.spill.items()},
            "overruled": self.overruled,
            "explored": self.explored,
            "reissued": self.reissued,
            "cancelled": self.cancelled,
        }


def _now() -> float:
    """The running loop's clock (simulated time in the in-process simulations), else the monotonic one."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


def _has_room(g: GeneratorRef, now: float) -> bool:
    """Whether `g` would start a call at once and is not saturated: a backlogged class's calls may go there
    (to a busy one, a continuous-batching engine that slows everything it runs, they would not)."""
    return g.backlog_s(now) == 0 and (g.busy is None or g.busy < SATURATED)


def _ewma(mean: float | None, value: float) -> float:
    return value if mean is None else mean + EWMA_WEIGHT * (value - mean)


def _drawn(pool: list[GeneratorRef], usable: Callable[[GeneratorRef], bool]) -> list[GeneratorRef]:
    """The usable generators of `pool` to score: all of a pool of up to `EXACT_POOL`, else two drawn at
    random (scanning for usable ones only when neither drawn is)."""
    if len(pool) > EXACT_POOL:
        drawn = [g for g in random.sample(pool, 2) if usable(g)]
        if drawn:
            return drawn
    return [g for g in pool if usable(g)]


def _least_loaded(pool: list[GeneratorRef], usable: Callable[[GeneratorRef], bool]) -> GeneratorRef | None:
    """The usable generator of `pool` with the fewest calls in flight (ties broken at random); in a
    pool larger than `EXACT_POOL`, the less loaded of two drawn at random, scanning only if neither
    of them is usable."""
    candidates = _drawn(pool, usable)
    if not candidates:
        return None
    least = min(g.in_flight for g in candidates)
    return random.choice([g for g in candidates if g.in_flight == least])


class _Down(RollartError):
    """The generator's session dropped while a call was in flight."""
