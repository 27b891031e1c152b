"""LLMProxy's pick of a generator for one call: class, failover, stickiness, least loaded, and what
a pick costs in a large class (two generators looked at, not all of them); then routing by predicted
finish time once a task has measured calls (`routing: finish-time`)."""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from typing import Any, cast

import pytest

from rollart.generation.engine import RecentBusy
from rollart.protocol import Session, State
from rollart.protocol.errors import RequestTimeout, SessionLost
from rollart.protocol.messages import Generate, Generated
from rollart.rollout.proxy import GenerationFailed, LLMProxy
from rollart.rollout.routing.base import EXACT_POOL, GeneratorRef, TaskProfiler
from rollart.rollout.routing.by_class import STICKY_SLACK
from rollart.rollout.routing.by_finish_time import OFF_CLASS, STICKY_MARGIN, FinishTimeRouter
from rollart.rollout.routing.spill import SATURATED, SPILL_GAP, SPILL_HOLD, SPILL_MAX, SPILL_STEP


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
    """Routing by finish time: a task without a measured call is routed by class all the same."""
    return LLMProxy(refs, TaskProfiler({}, ratio=4.0), timeout_s=1.0, routing="finish-time")


def finish_time(p: LLMProxy) -> FinishTimeRouter:
    """The router of a proxy built with `routing: finish-time`."""
    assert isinstance(p.router, FinishTimeRouter)
    return p.router


def picks(
    p: LLMProxy, want: str, n: int = 200, trajectory: str = "t", task: str = "unmeasured"
) -> collections.Counter[str]:
    chosen = collections.Counter[str]()
    for _ in range(n):
        g = p._pick(trajectory, task, want, set())
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
    p._pick("t", "unmeasured", "compute", set())
    assert Looked.reads == 3  # a small class: every generator is looked at


# -- routing by predicted finish time ------------------------------------------------------------


def measured(
    p: LLMProxy,
    g: GeneratorRef,
    task: str,
    service_s: float,
    *,
    running: int = 1,
    waiting: int = 0,
    busy: float | None = None,
) -> None:
    """`g` served a call of `task` in `service_s` once started, and then reported this load."""
    p._record(g, task, service_s, reply(running=running, waiting=waiting, busy=busy), time.monotonic())


def reply(
    *, running: int = 0, waiting: int = 0, queued_s: float = 0.0, finish: str = "stop", busy: float | None = None
) -> Generated:
    return Generated(
        "r", [1], [0.0], [0], finish, 10, "g", queued_s=queued_s, running=running, waiting=waiting, busy=busy
    )


def spill_moves(p: LLMProxy, times: int) -> None:
    """`times` periods of `SPILL_EVERY_S` pass."""
    for _ in range(times):
        finish_time(p).spill.move()


def test_finish_time_sends_a_call_outside_its_class_when_the_class_is_backlogged() -> None:
    refs = generators("bandwidth", [0]) + generators("compute", [0])
    band, comp = refs
    p = proxy(refs)
    measured(p, band, "math", 10.0, running=10)
    measured(p, comp, "math", 15.0)
    assert set(picks(p, "bandwidth", task="math")) - {"compute-0"} == {"bandwidth-0"}  # 10 s against 15 s
    assert picks(p, "bandwidth", task="math", n=1000)["bandwidth-0"] > 950  # but for a few explorations
    # 20 queued behind 10 running calls of ~10 s: a new call starts in ~20 s, finishes in ~30 s there.
    measured(p, band, "math", 10.0, running=10, waiting=20)
    assert band.backlog_s(band.reported_at) == pytest.approx(20.0)
    assert band.backlog_s(band.reported_at + 15.0) == pytest.approx(5.0)  # worked off meanwhile
    assert band.backlog_s(band.reported_at + 25.0) == 0.0
    finish_time(p).overruled = 0
    assert picks(p, "bandwidth", task="math", n=1000)["compute-0"] > 950
    assert finish_time(p).overruled > 950
    # Not to a class with no room: a saturated generator slows whatever it takes on.
    measured(p, comp, "math", 15.0, busy=SATURATED)
    measured(p, band, "math", 10.0, running=10, waiting=20)
    assert picks(p, "bandwidth", task="math", n=1000)["bandwidth-0"] > 950
    measured(p, comp, "math", 15.0, busy=SATURATED - SPILL_GAP)
    measured(p, band, "math", 10.0, running=10, waiting=20)
    assert picks(p, "bandwidth", task="math", n=1000)["compute-0"] > 950
    # Calls sent there since its last report join its queue: the estimate rises with each.
    before = band.backlog_s(band.reported_at)
    band.sent_since_report += 5
    assert band.backlog_s(band.reported_at) == pytest.approx(before * 25 / 20)


def test_a_class_a_task_never_ran_on_is_tried_and_then_judged_by_what_it_measured() -> None:
    refs = generators("bandwidth", [0]) + generators("compute", [0])
    band, comp = refs
    p = proxy(refs)
    # its own class, slowed by its load: no queue, only slow, and saturated while the other has room
    measured(p, band, "math", 10.0, running=200, busy=1.0)
    measured(p, comp, "game", 1.0, busy=0.3)
    spill_moves(p, 30)
    assert finish_time(p).spill.fractions == {"bandwidth": SPILL_MAX, "compute": 0.0}
    now = time.monotonic()
    assert finish_time(p).estimate_s(comp, "math", "bandwidth", now) == pytest.approx(10.0 * OFF_CLASS)  # as there
    assert finish_time(p).estimate_s(band, "math", "bandwidth", now) == pytest.approx(10.0)
    measured(p, comp, "math", 6.0)  # tried: faster, though off its class
    assert picks(p, "bandwidth", task="math", n=1000)["compute-0"] > 1000 * SPILL_MAX - 50  # each spilled call
    for _ in range(20):  # the class caught up (its mean follows its calls): back to it
        measured(p, band, "math", 4.0, running=100)
    assert picks(p, "bandwidth", task="math", n=1000)["bandwidth-0"] > 950
    # A class-mate that has not run the task is judged by its class's mean.
    more = generators("compute", [0], prefix="compute-new")[0]
    old, new = finish_time(p), finish_time(proxy([band, comp, more]))
    new.task_service_s, new.class_service_s = old.task_service_s, old.class_service_s
    guess = new.estimate_s(more, "math", "bandwidth", time.monotonic())
    assert guess == pytest.approx(old.class_service_s[("math", "compute")] * OFF_CLASS)


def test_a_saturated_class_spills_while_another_has_room_and_stops_once_they_are_level() -> None:
    refs = generators("bandwidth", [0]) + generators("compute", [0])
    band, comp = refs
    p = proxy(refs)
    measured(p, band, "math", 10.0, running=100)
    measured(p, comp, "math", 5.0)  # quicker for one call: not a reason to leave a class with room
    assert picks(p, "bandwidth", task="math", n=1000)["bandwidth-0"] > 950
    spill_moves(p, 5)
    assert finish_time(p).spill.fractions["bandwidth"] == 0.0  # nothing said how busy they are
    measured(p, band, "math", 10.0, running=100, busy=SATURATED)
    measured(p, comp, "game", 1.0, busy=SATURATED - SPILL_GAP)
    spill_moves(p, 4)
    assert finish_time(p).spill.fractions == {"bandwidth": pytest.approx(4 * SPILL_STEP), "compute": 0.0}
    spilled = picks(p, "bandwidth", task="math", n=4000)["compute-0"] / 4000
    assert 4 * SPILL_STEP - 0.05 < spilled < 4 * SPILL_STEP + 0.05
    measured(p, comp, "game", 1.0, busy=SATURATED - SPILL_GAP / 2)  # between the thresholds: it holds
    spill_moves(p, 4)
    assert finish_time(p).spill.fractions["bandwidth"] == pytest.approx(4 * SPILL_STEP)
    measured(p, comp, "game", 1.0, busy=SATURATED - SPILL_HOLD / 2)  # near level: it comes back
    spill_moves(p, 10)
    assert finish_time(p).spill.fractions["bandwidth"] == 0.0
    measured(p, band, "math", 10.0, running=100, busy=SATURATED - 2 * SPILL_HOLD)
    measured(p, comp, "game", 1.0, busy=0.1)
    spill_moves(p, 10)
    assert finish_time(p).spill.fractions["bandwidth"] == 0.0  # room of its own: no spill however idle the other


def test_a_task_without_a_measured_call_and_routing_class_go_by_class() -> None:
    refs = generators("bandwidth", [5]) + generators("compute", [0])
    p = proxy(refs)
    assert set(picks(p, "bandwidth", task="math")) == {"bandwidth-0"}  # nothing measured yet
    measured(p, refs[0], "math", 10.0, running=10, waiting=50)
    assert picks(p, "bandwidth", task="math", n=1000)["compute-0"] > 950
    by_class = LLMProxy(refs, TaskProfiler({}, ratio=4.0), timeout_s=1.0, routing="class")
    measured(by_class, refs[0], "math", 10.0, running=10, waiting=50)  # the same calls measured: no matter
    assert set(picks(by_class, "bandwidth", task="math")) == {"bandwidth-0"}


def test_finish_time_keeps_a_trajectory_on_its_generator_within_the_margin() -> None:
    refs = generators("compute", [0, 0])
    p = proxy(refs)
    measured(p, refs[0], "game", 1.0)
    measured(p, refs[1], "game", 1.0 + STICKY_MARGIN * 0.9)
    p.sticky["t"] = "compute-1"
    assert picks(p, "compute", task="game", n=1000)["compute-1"] > 950  # but for a few explorations
    measured(p, refs[1], "game", 3.0)  # its mean moves past the margin
    assert picks(p, "compute", task="game", n=1000)["compute-0"] > 950


def test_finish_time_picks_look_at_a_few_generators_however_many_there_are() -> None:
    refs = generators("compute", [0] * 1000) + generators("bandwidth", [0] * 1000)
    p = proxy(refs)
    measured(p, refs[0], "game", 1.0)
    Looked.reads = 0
    picks(p, "compute", n=500, task="game", trajectory="")
    assert Looked.reads <= 4 * 500  # two drawn from the class, two from the others


def test_an_aborted_call_measures_nothing() -> None:
    refs = generators("compute", [0])
    p = proxy(refs)
    p._record(refs[0], "game", 0.01, reply(finish="abort"), time.monotonic())
    assert "game" not in finish_time(p).task_service_s and refs[0].service_s == {}


class Answers:
    """A session whose requests answer after `delay_s` of loop time, saying `queued_s` of it was queueing."""

    state = State.UP

    def __init__(self, delay_s: float, queued_s: float) -> None:
        self.delay_s, self.queued_s = delay_s, queued_s
        self.down = asyncio.Event()

    async def request(self, msg: Any, timeout: float) -> Generated:
        await asyncio.sleep(self.delay_s)
        return reply(running=3, waiting=1, queued_s=self.queued_s)


async def test_a_call_is_timed_on_the_loop_clock_less_the_queueing_the_generator_reports() -> None:
    ref = GeneratorRef("gen", "compute", cast(Session, Answers(delay_s=0.2, queued_s=0.15)))
    p = proxy([ref])
    await p.generate("game", Generate("r", "t", [1, 2], max_tokens=4))
    assert ref.service_s["game"] == pytest.approx(0.05, abs=0.04)
    assert (ref.running, ref.waiting, ref.sent_since_report) == (3, 1, 0)
    assert finish_time(p).task_service_s["game"] == ref.service_s["game"]


class Reconnecting:
    """A session that drops during its first request and is up again `back_s` later: `resumed`, the request
    survives and is answered; else the peer had restarted and the request is lost with the old session."""

    def __init__(self, back_s: float, *, resumed: bool) -> None:
        self.back_s, self.resumed, self.calls, self.state = back_s, resumed, 0, State.UP
        self.up, self.down = asyncio.Event(), asyncio.Event()
        self.up.set()

    async def request(self, msg: Any, timeout: float) -> Generated:
        self.calls += 1
        if self.calls == 1:
            self.state = State.DOWN
            self.up.clear()
            self.down.set()
            asyncio.get_running_loop().call_later(self.back_s, self._back)
            try:
                async with asyncio.timeout(timeout):
                    await self.up.wait()
            except TimeoutError:
                raise RequestTimeout(f"timed out after {timeout} s") from None
            if not self.resumed:
                raise SessionLost("the peer restarted")
        return reply()

    def _back(self) -> None:
        self.state = State.UP
        self.down.clear()
        self.up.set()


def lone(session: Reconnecting, timeout_s: float = 5.0) -> LLMProxy:
    """A proxy of one generator on `session`, with attempts a reconnect would use up in a few ms of backoff."""
    ref = GeneratorRef("gen", "compute", cast(Session, session))
    return LLMProxy([ref], TaskProfiler({}, ratio=4.0), timeout_s=timeout_s, attempts=3, backoff_base_s=0.001)


async def test_a_call_on_the_only_generator_waits_for_its_session_to_resume_and_is_sent_once() -> None:
    session = Reconnecting(back_s=0.3, resumed=True)
    p = lone(session)
    result = await asyncio.wait_for(p.generate("game", Generate("r", "t", [1, 2], max_tokens=4)), 10)
    assert result.finish_reason == "stop" and (session.calls, p.reissued) == (1, 0)


async def test_a_call_lost_with_its_only_generators_session_is_sent_again_once_it_is_back() -> None:
    session = Reconnecting(back_s=0.3, resumed=False)
    p = lone(session)
    result = await asyncio.wait_for(p.generate("game", Generate("r", "t", [1, 2], max_tokens=4)), 10)
    assert result.finish_reason == "stop" and (session.calls, p.reissued) == (2, 1)


async def test_a_call_fails_once_no_generator_comes_up_within_its_timeout() -> None:
    p = lone(Reconnecting(back_s=60.0, resumed=True), timeout_s=0.3)
    with pytest.raises(GenerationFailed, match=r"failed \(1 calls made\); last: no generator came up within 0\.3 s"):
        await asyncio.wait_for(p.generate("game", Generate("r", "t", [1, 2], max_tokens=4)), 10)


def test_a_generator_reports_how_busy_it_was_lately_not_since_it_started() -> None:
    recent = RecentBusy(window_s=10.0)
    assert recent.update(1.0, 100.0) == 1.0  # nothing measured yet: the fraction since start
    assert recent.update(1.0, 110.0) == 1.0
    assert recent.update(0.5, 120.0) == 0.0  # idle for the last 10 s, though busy half the time since start
    assert recent.update(10 / 25, 125.0) == 0.0
    assert recent.update(10 / 30, 130.0) == 0.0
    assert recent.update(20 / 40, 140.0) == pytest.approx(1.0)  # busy again
    assert recent.update(25 / 45, 145.0) == pytest.approx(1.0)


class Records:
    """A session that answers at once as generator `name`, keeping what it was sent."""

    def __init__(self, name: str, *, up: bool = True) -> None:
        self.name = name
        self.sent: list[Generate] = []
        self.state = State.UP if up else State.DOWN
        self.up, self.down = asyncio.Event(), asyncio.Event()
        (self.up if up else self.down).set()

    async def request(self, msg: Generate, timeout: float) -> Generated:
        self.sent.append(msg)
        tokens = [] if msg.prefill_only else [1, 2]
        return Generated(msg.request_id, tokens, [0.0] * len(tokens), [0] * len(tokens), "length", 10, self.name)


async def test_disaggregated_routing_prefills_on_compute_and_decodes_on_bandwidth_with_its_kv() -> None:
    compute, bandwidth = Records("gen-c"), Records("gen-b")
    refs = [
        GeneratorRef("gen-c", "compute", cast(Session, compute)),
        GeneratorRef("gen-b", "bandwidth", cast(Session, bandwidth)),
    ]
    p = LLMProxy(refs, TaskProfiler({"game": "prefill-heavy"}, ratio=4.0), timeout_s=1.0, routing="disaggregated")
    result = await p.generate("game", Generate("r", "t", [1] * 10, max_tokens=4))
    ((prefill,), (decode,)) = compute.sent, bandwidth.sent
    assert (prefill.request_id, prefill.prefill_only, prefill.kv_from) == ("r/prefill", True, None)
    assert (decode.request_id, decode.prefill_only, decode.kv_from) == ("r", False, "gen-c/r/prefill")
    assert result.generator == "gen-b" and result.token_ids == [1, 2]
    assert p.sticky["t"] == "gen-b" and (refs[0].prefills, dict(refs[0].calls)) == (1, {})
    assert dict(refs[1].calls) == {"prefill-heavy": 1} and p.profiler.samples["game"] == 1  # one turn, once
    # with no bandwidth generator up, the turn is whole, on the compute class (failover)
    alone = [
        GeneratorRef("gen-c", "compute", cast(Session, Records("gen-c"))),
        GeneratorRef("gen-b", "bandwidth", cast(Session, Records("gen-b", up=False))),
    ]
    p = LLMProxy(alone, TaskProfiler({"game": "prefill-heavy"}, ratio=4.0), timeout_s=1.0, routing="disaggregated")
    whole = await p.generate("game", Generate("r", "t", [1] * 10, max_tokens=4))
    assert whole.generator == "gen-c" and not cast(Records, alone[0].session).sent[0].prefill_only
