"""LLMProxy: sends each generation call of a trajectory to a generator, in the env-host, and sees it
answered.

Which generator takes a call is the router's pick (`rollart.rollout.routing`), chosen once from
`rollout.routing` when the proxy is built: `class` (the paper's hardware affinity, `by_class`),
`finish-time` (`by_finish_time`), or `disaggregated`, which sends each turn in two halves, a prefill on
a `compute` generator and a decode on a `bandwidth` one, each routed as `class` routes a turn. The proxy
keeps what every routing shares:

- **start-up**: a call whose class has sessions all still connecting waits up to `CONNECT_WAIT_S` for
  one before the router may fail it over to another class;
- **re-issue**: a call that times out, or whose generator's session drops, is re-issued on another
  generator after a full-jitter backoff; a generator that failed is avoided for `COOL_DOWN_S`;
- **waiting instead of failing**: a call whose session drops while no other generator is up waits for
  that session (it resumes with the call, nothing lost or run twice), and while no generator is up at
  all, a call waits for one, up to its timeout, without using an attempt;
- **measuring**: each answered call's service time (its time less the `queued_s` the generator
  reports) and the load its generator reported, for the router and the status.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import structlog

from rollart.errors import RollartError
from rollart.protocol import State
from rollart.protocol.errors import RemoteError, RequestTimeout, SessionLost, UnexpectedReply
from rollart.protocol.messages import Generate, Generated
from rollart.protocol.retry import Backoff
from rollart.rollout.config import Profile, Routing
from rollart.rollout.routing.base import CLASS_FOR, GeneratorRef, Pool, Router, TaskProfiler, loop_time
from rollart.rollout.routing.by_class import ClassRouter
from rollart.rollout.routing.by_finish_time import FinishTimeRouter

log = structlog.get_logger("rollart.rollout.proxy")

COOL_DOWN_S = 2.0
"""How long a generator whose call failed is left out of picks."""
CONNECT_WAIT_S = 30.0
"""How long a call waits for a hardware class whose sessions have never come up before failing over."""

ROUTERS: dict[Routing, Callable[[Pool, dict[str, str]], Router]] = {
    "class": ClassRouter,
    "finish-time": FinishTimeRouter,
    "disaggregated": ClassRouter,  # each half of a turn, as class routing routes a whole one
}
"""The router each `rollout.routing` builds, given the pool and where each trajectory's last turn ran."""


class GenerationFailed(RollartError):
    """Every attempt to generate a turn failed."""


class LLMProxy:
    """Sends generation calls to the generators its router picks; re-issues them when a generator fails."""

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
        self.pool = Pool(generators)
        self.routing = routing
        self.sticky: dict[str, str] = {}
        """Per trajectory: the generator its previous turn ran on (its prefix is cached there)."""
        self.router = ROUTERS[routing](self.pool, self.sticky)
        self.split_turns = routing == "disaggregated"
        """Whether each turn is sent as a prefill half and a decode half."""
        self._started: set[str] = set()
        """Classes with a generator past its first connection: no start-up wait for them again."""
        self.profiler = profiler
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.backoff = Backoff(backoff_base_s, backoff_cap_s)  # full jitter
        self.reissued = 0
        self.cancelled = 0

    def _pick(self, trajectory_id: str, task: str, want: str, excluded: set[str]) -> GeneratorRef | None:
        """The router's pick among generators up, out of their cool-down and not yet `excluded` for this call."""
        now = time.monotonic()

        def usable(g: GeneratorRef) -> bool:
            return g.session.state is State.UP and g.avoid_until <= now and g.name not in excluded

        return self.router.pick(trajectory_id, task, want, usable)

    async def _first_connection(self, want: str) -> None:
        """Wait (bounded) while every generator of class `want` is still making its first connection."""
        if want in self._started:  # the common case: checked once per call, so kept O(1)
            return
        mine = self.pool.by_class.get(want, [])
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
        if self.split_turns and await self._both_up():
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
            if not any(g.session.state is State.UP for g in self.pool.by_class.get(hardware, [])):
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
            sent_at = loop_time()
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
                now = loop_time()
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
        """A call answered: what it measured, for its generator and the router."""
        if result.finish_reason == "abort":
            return  # cut short: says nothing of what a whole call takes
        generator.record(task, service_s, result, now)
        self.router.record(generator, task, service_s, now)

    def forget(self, trajectory_id: str) -> None:
        """The trajectory ended: no turn of it will look for its prefix again."""
        self.sticky.pop(trajectory_id, None)

    def describe(self) -> dict[str, object]:
        now = loop_time()
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
            **self.router.describe(),
            "reissued": self.reissued,
            "cancelled": self.cancelled,
        }


class _Down(RollartError):
    """The generator's session dropped while a call was in flight."""
