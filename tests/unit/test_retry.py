"""Tests of the bounded retry helper (`rollart.protocol.retry`), on a fake clock: no test sleeps.

It gives up with a clear error after N tries or at its deadline, the backoff grows and is capped,
the jitter stays within its bounds, each retry is logged, and errors it was not told to retry pass
through at once.
"""

from __future__ import annotations

import random

import pytest
from structlog.testing import capture_logs

from rollart.protocol.config import SessionConfig
from rollart.protocol.errors import RemoteError, RequestTimeout, SessionLost
from rollart.protocol.retry import RETRY_JITTER, Backoff, RetriesExhausted, retry


class FakeTime:
    """A clock that only moves when the code under test sleeps; records every sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


class Flaky:
    """Fails with `error` `failures` times, then answers `"ok"`; counts its calls."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or RequestTimeout("no answer")
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


NO_JITTER = Backoff(1.0, 8.0, jitter=0.0)


async def test_a_call_that_recovers_returns_its_answer_after_growing_delays() -> None:
    fake, call = FakeTime(), Flaky(3)
    with capture_logs() as logs:
        answer = await retry(
            call, what="hand-in", retry_on=(RequestTimeout,), backoff=NO_JITTER, attempts=5, sleep=fake.sleep
        )
    assert answer == "ok" and call.calls == 4
    assert fake.sleeps == [1.0, 2.0, 4.0]
    assert [(e["event"], e["what"], e["attempt"], e["error"]) for e in logs] == [
        ("retry.again", "hand-in", n, "no answer") for n in (1, 2, 3)
    ]


async def test_gives_up_after_the_attempts_with_an_error_naming_what_and_the_last_error() -> None:
    fake, call = FakeTime(), Flaky(10, RemoteError("draining", "not now"))
    with pytest.raises(RetriesExhausted) as info:
        await retry(
            call,
            what="group g-1",
            retry_on=(RemoteError,),
            backoff=NO_JITTER,
            attempts=3,
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert call.calls == 3 and len(fake.sleeps) == 2  # no sleep after the last try
    assert str(info.value) == "group g-1: gave up after 3 tries in 3.0 s; last error: draining: not now"
    assert isinstance(info.value.__cause__, RemoteError)


async def test_gives_up_at_the_deadline_and_the_last_try_is_at_it_not_after() -> None:
    fake, call = FakeTime(), Flaky(100)
    with pytest.raises(RetriesExhausted, match=r"gave up after 5 tries in 10\.0 s"):
        await retry(
            call,
            what="x",
            retry_on=(RequestTimeout,),
            backoff=NO_JITTER,
            deadline_s=10.0,
            sleep=fake.sleep,
            clock=fake.clock,
        )
    assert fake.sleeps == [1.0, 2.0, 4.0, 3.0]  # the last delay is cut to the deadline
    assert fake.now == 110.0


async def test_errors_not_to_retry_pass_through_at_once() -> None:
    fake, call = FakeTime(), Flaky(1, SessionLost("gone"))
    with pytest.raises(SessionLost):
        await retry(call, what="x", retry_on=(RequestTimeout,), backoff=NO_JITTER, attempts=5, sleep=fake.sleep)
    assert call.calls == 1 and fake.sleeps == []


async def test_an_unbounded_retry_is_refused() -> None:
    with pytest.raises(ValueError, match="an unbounded retry is a hang"):
        await retry(Flaky(0), what="x", retry_on=(RequestTimeout,), backoff=NO_JITTER)


def test_the_backoff_bound_doubles_up_to_its_cap() -> None:
    backoff = Backoff(0.5, 4.0)
    assert [backoff.bound(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.bound(10_000) == 4.0  # no overflow however long it has failed


@pytest.mark.parametrize("jitter", [0.0, 0.5, 1.0])
def test_jittered_delays_stay_within_their_bounds_and_spread_over_them(jitter: float) -> None:
    backoff, rng = Backoff(1.0, 8.0, jitter=jitter), random.Random(7)
    for attempt in range(6):
        bound = backoff.bound(attempt)
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(bound * (1 - jitter) <= d <= bound for d in delays)
        assert max(delays) - min(delays) >= 0.8 * jitter * bound  # jitter is used, not just allowed


def test_the_retry_settings_build_the_backoff_and_are_checked() -> None:
    cfg = SessionConfig()
    assert Backoff.for_retries(cfg) == Backoff(1.0, 10.0, RETRY_JITTER)
    assert (cfg.long_poll_slack_s, cfg.probe_timeout_s, cfg.retry_deadline_s) == (15.0, 10.0, 300.0)
    bad = SessionConfig(retry_base_s=5.0, retry_cap_s=1.0)
    assert ("retry_cap_s", "expected at least retry_base_s (5.0); got 1.0") in bad.validate()
    with pytest.raises(ValueError, match="expected 0 < base_s <= cap_s"):
        Backoff(2.0, 1.0)
